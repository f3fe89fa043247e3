// Tests of the dtrun launcher: runs the built dtrun (DTRUN_PATH) on small /bin/sh programs.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using EnvChanges = std::vector<std::pair<std::string, std::optional<std::string>>>;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One dtrun process with its stdout and stderr captured separately.
class Dtrun {
 public:
  explicit Dtrun(const std::vector<std::string>& args, const EnvChanges& env = {}) {
    // Everything the child needs is prepared before fork().
    std::vector<std::string> argv_s{DTRUN_PATH};
    // Forked ranks unless a test asks for another engine: what these tests check (signals,
    // exit codes, output lines) is dtrun's own handling of the ranks it starts.
    if (std::find(args.begin(), args.end(), "--backend") == args.end()) {
      argv_s.insert(argv_s.end(), {"--backend", "gloo"});
    }
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::map<std::string, std::string> env_map;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      auto eq = kv.find('=');
      if (eq != std::string::npos) env_map[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    for (const auto& [k, v] : env) {
      if (v) {
        env_map[k] = *v;
      } else {
        env_map.erase(k);
      }
    }
    std::vector<std::string> env_s;
    for (const auto& [k, v] : env_map) env_s.push_back(k + "=" + v);
    std::vector<char*> argv, envp;
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    for (auto& s : env_s) envp.push_back(s.data());
    envp.push_back(nullptr);

    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "pipe2: " << std::strerror(errno);
      return;
    }
    start_ = Clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(126);
    }
    ::close(out[1]);
    ::close(err[1]);
    fds_[0] = out[0];
    fds_[1] = err[0];
    if (pid_ < 0) ADD_FAILURE() << "fork: " << std::strerror(errno);
  }

  Dtrun(const Dtrun&) = delete;
  Dtrun& operator=(const Dtrun&) = delete;

  ~Dtrun() {
    if (pid_ > 0 && !exit_status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }

  // Reads output until `needle` has appeared `count` times in stdout+stderr, or the timeout.
  bool wait_for(const std::string& needle, int count = 1, double timeout_s = 20) {
    auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (occurrences(out_ + err_, needle) < count) {
      if (Clock::now() >= deadline || !pump(100)) return false;
    }
    return true;
  }

  void signal(int sig) { ::kill(pid_, sig); }

  // Waits for dtrun to exit (killing it after `timeout_s`). Returns its exit code, 128+signal
  // when dtrun itself died of a signal, or -1 on timeout.
  int finish(double timeout_s = 30) {
    auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (pump(100) && Clock::now() < deadline) {
    }
    int status = 0;
    while (true) {
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) break;
      if (Clock::now() >= deadline) {
        ADD_FAILURE() << "dtrun did not exit within " << timeout_s << " s; killing it";
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        exit_status_ = status;
        return -1;
      }
      ::usleep(10000);
    }
    exit_status_ = status;
    elapsed_s_ = seconds_since(start_);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }
  double elapsed_s() const { return elapsed_s_; }

 private:
  static int occurrences(const std::string& s, const std::string& needle) {
    int n = 0;
    for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
    return n;
  }

  // Reads what is available; false once both streams are at end of file.
  bool pump(int timeout_ms) {
    std::vector<pollfd> p;
    std::vector<int> which;
    for (int i = 0; i < 2; ++i) {
      if (fds_[i] < 0) continue;
      p.push_back({fds_[i], POLLIN, 0});
      which.push_back(i);
    }
    if (p.empty()) return false;
    if (::poll(p.data(), p.size(), timeout_ms) <= 0) return true;
    for (size_t k = 0; k < p.size(); ++k) {
      if (!p[k].revents) continue;
      char buf[4096];
      ssize_t n = ::read(p[k].fd, buf, sizeof buf);
      if (n > 0) {
        (which[k] == 0 ? out_ : err_).append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds_[which[k]]);
        fds_[which[k]] = -1;
      }
    }
    return true;
  }

  pid_t pid_ = -1;
  int fds_[2] = {-1, -1};
  std::string out_, err_;
  Clock::time_point start_;
  std::optional<int> exit_status_;
  double elapsed_s_ = 0;
};

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> lines;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Process ids that the ranks printed as "pid N [M ...]".
std::vector<pid_t> printed_pids(const std::string& out) {
  std::vector<pid_t> pids;
  std::regex re(R"(pid((?: \d+)+))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) {
    std::istringstream nums((*it)[1].str());
    for (long p; nums >> p;) pids.push_back(static_cast<pid_t>(p));
  }
  return pids;
}

// Alive and not a zombie.
bool running(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  auto close_paren = line.rfind(')');
  return close_paren == std::string::npos || close_paren + 2 >= line.size() ||
         line[close_paren + 2] != 'Z';
}

// Expects none of `pids` to be running; kills any that are, so a failing test leaves nothing.
void expect_all_gone(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) {
    EXPECT_FALSE(running(pid)) << "process " << pid << " started by a rank is still running";
    if (running(pid)) ::kill(pid, SIGKILL);
  }
}

std::vector<std::string> sh(int n, const std::string& script, std::vector<std::string> opts = {}) {
  std::vector<std::string> args{"-n", std::to_string(n)};
  args.insert(args.end(), opts.begin(), opts.end());
  args.insert(args.end(), {"/bin/sh", "-c", script});
  return args;
}

TEST(Dtrun, AllRanksSucceedingExitsZeroAndPrefixesEveryLineWithItsRank) {
  Dtrun run(
      sh(3, R"(echo "line one of $RANK"; echo "line two of $RANK"; echo "err of $RANK" >&2)"));
  ASSERT_EQ(run.finish(), 0) << run.err();
  auto out = lines_of(run.out());
  auto err = lines_of(run.err());
  ASSERT_EQ(out.size(), 6u) << run.out();
  ASSERT_EQ(err.size(), 3u) << run.err();
  std::regex out_re(R"(\[rank (\d)\] line (one|two) of (\d))");
  std::multiset<std::string> seen;
  for (const auto& line : out) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, out_re)) << line;
    EXPECT_EQ(m[1], m[3]) << "line printed by rank " << m[3] << " has prefix of rank " << m[1];
    seen.insert(m[1]);
  }
  EXPECT_EQ(seen, (std::multiset<std::string>{"0", "0", "1", "1", "2", "2"}));
  for (const auto& line : err) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, std::regex(R"(\[rank (\d)\] err of (\d))"))) << line;
    EXPECT_EQ(m[1], m[2]);
  }
}

TEST(Dtrun, EachRankGetsTorchrunEnvironmentWithLoopbackAddressAndOneFreePort) {
  Dtrun run(sh(3,
               "echo \"RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE "
               "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR "
               "MASTER_PORT=$MASTER_PORT OMP_NUM_THREADS=$OMP_NUM_THREADS\""),
            {{"OMP_NUM_THREADS", std::nullopt},
             {"MASTER_ADDR", std::nullopt},
             {"MASTER_PORT", std::nullopt},
             {"RANK", "7"}});
  ASSERT_EQ(run.finish(), 0) << run.err();
  std::regex re(R"(\[rank (\d)\] RANK=(\d) LOCAL_RANK=(\d) WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 )"
                R"(MASTER_ADDR=127\.0\.0\.1 MASTER_PORT=(\d+) OMP_NUM_THREADS=1)");
  std::set<std::string> ranks, ports;
  auto lines = lines_of(run.out());
  ASSERT_EQ(lines.size(), 3u) << run.out();
  for (const auto& line : lines) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, re)) << line;
    EXPECT_EQ(m[1], m[2]);
    EXPECT_EQ(m[2], m[3]);
    ranks.insert(m[2]);
    ports.insert(m[4]);
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"0", "1", "2"}));
  ASSERT_EQ(ports.size(), 1u) << "all ranks must get the same MASTER_PORT";
  int port = std::stoi(*ports.begin());
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);
}

TEST(Dtrun, MasterAddrAndPortOptionsAndAnExistingOmpNumThreadsArePassedThrough) {
  Dtrun run(sh(2, R"(echo "$MASTER_ADDR:$MASTER_PORT omp=$OMP_NUM_THREADS")",
               {"--master-addr", "10.1.2.3", "--master-port=29555", "--"}),
            {{"OMP_NUM_THREADS", "7"}});
  ASSERT_EQ(run.finish(), 0) << run.err();
  auto lines = lines_of(run.out());
  std::sort(lines.begin(), lines.end());
  EXPECT_EQ(lines, (std::vector<std::string>{"[rank 0] 10.1.2.3:29555 omp=7",
                                             "[rank 1] 10.1.2.3:29555 omp=7"}));
}

// One node of several, as torchrun --nnodes 3 --node-rank 1: global ranks 2 and 3 of 6.
TEST(Dtrun, NodeRankOffsetsTheRanksAndWorldSizeCountsEveryNode) {
  Dtrun run(sh(2,
               "echo \"RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE "
               "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK "
               "MASTER=$MASTER_ADDR:$MASTER_PORT\"",
               {"--nnodes", "3", "--node-rank", "1", "--master-addr", "10.1.2.3", "--master-port",
                "29555", "--"}));
  ASSERT_EQ(run.finish(), 0) << run.err();
  auto lines = lines_of(run.out());
  std::sort(lines.begin(), lines.end());
  EXPECT_EQ(lines, (std::vector<std::string>{
                       "[rank 2] RANK=2 LOCAL_RANK=0 WORLD_SIZE=6 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 "
                       "MASTER=10.1.2.3:29555",
                       "[rank 3] RANK=3 LOCAL_RANK=1 WORLD_SIZE=6 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 "
                       "MASTER=10.1.2.3:29555"}));
}

TEST(Dtrun, CarriageReturnsArePrefixedLikeLineEndsButKept) {
  Dtrun run(sh(1, R"(printf '\r10%%\r20%%\rdone\r\n')"));
  ASSERT_EQ(run.finish(), 0) << run.err();
  EXPECT_EQ(run.out(), "\r[rank 0] 10%\r[rank 0] 20%\r[rank 0] done\r\n");
}

TEST(Dtrun, PartialLastLineIsPrintedWithPrefixAtExit) {
  Dtrun run(sh(1, R"(printf 'whole\npartial'; printf 'no newline' >&2)"));
  ASSERT_EQ(run.finish(), 0) << run.err();
  EXPECT_EQ(run.out(), "[rank 0] whole\n[rank 0] partial\n");
  EXPECT_EQ(run.err(), "[rank 0] no newline\n");
}

TEST(Dtrun, NoPrefixPassesOutputThroughUnchanged) {
  Dtrun run(sh(1, R"(printf 'a\nb\r\nc'; printf 'e\n' >&2)", {"--no-prefix"}));
  ASSERT_EQ(run.finish(), 0) << run.err();
  EXPECT_EQ(run.out(), "a\nb\r\nc");
  EXPECT_EQ(run.err(), "e\n");
}

TEST(Dtrun, FailingRankStopsTheOthersAndDtrunExitsWithItsCode) {
  // Ranks 0 and 2 print their shell's pid and a background sleep's pid, then wait forever.
  Dtrun run(sh(3, R"(if [ "$RANK" = 1 ]; then sleep 1; exit 3; fi
sleep 60 & echo "pid $$ $!"; wait)"));
  int code = run.finish();
  auto pids = printed_pids(run.out());
  EXPECT_EQ(code, 3) << run.err();
  EXPECT_LT(run.elapsed_s(), 4.0)
      << "SIGTERM should stop the other ranks well before the 5 s grace";
  EXPECT_NE(run.err().find("dtrun: rank 1 exited with code 3; stopping the other ranks"),
            std::string::npos)
      << run.err();
  EXPECT_EQ(pids.size(), 4u) << run.out();
  expect_all_gone(pids);
}

// dtensor_train's and dtensor_generate's last words, "NAME: error on rank R: MESSAGE": said once
// when several ranks say the same, a failing rank's peers given a moment to fail on their own.
TEST(Dtrun, RanksFailingAlikePrintTheirErrorOnceNamingEveryRank) {
  Dtrun run(sh(2, R"(if [ "$RANK" = 1 ]; then sleep 0.3; fi
echo "prog: error on rank $RANK: cannot open /no/such/dir" >&2; exit 1)"));
  EXPECT_EQ(run.finish(), 1) << run.err();
  const auto err = lines_of(run.err());
  EXPECT_EQ(std::count(err.begin(), err.end(),
                       "prog: error on every rank (2 of 2): cannot open /no/such/dir"),
            1)
      << run.err();
  EXPECT_EQ(run.err().find("error on rank"), std::string::npos) << run.err();
  EXPECT_EQ(std::count(err.begin(), err.end(), "dtrun: rank 0 exited with code 1"), 1) << run.err();
}

TEST(Dtrun, DistinctRankErrorsArePrintedAsTheyAreAndSharedOnesOnce) {
  Dtrun run(sh(3, R"(if [ "$RANK" = 1 ]; then m="peer rank 0 failed"; else m="bad key w"; fi
echo "prog: error on rank $RANK: $m" >&2; exit 1)"));
  EXPECT_EQ(run.finish(), 1) << run.err();
  const auto err = lines_of(run.err());
  for (const char* line : {"prog: error on ranks 0, 2 (2 of 3): bad key w",
                           "[rank 1] prog: error on rank 1: peer rank 0 failed"}) {
    EXPECT_EQ(std::count(err.begin(), err.end(), line), 1) << line << "\n" << run.err();
  }
  EXPECT_EQ(err.size(), 3u) << run.err();  // and dtrun's own line
}

TEST(Dtrun, ErrorLineFollowedByMoreOutputIsPrintedInPlace) {
  Dtrun run(sh(1, R"(echo "prog: error on rank 0: not fatal" >&2; echo "still here" >&2)"));
  EXPECT_EQ(run.finish(), 0) << run.err();
  EXPECT_EQ(run.err(), "[rank 0] prog: error on rank 0: not fatal\n[rank 0] still here\n");
}

TEST(Dtrun, RankKilledBySignalGives128PlusSignal) {
  Dtrun run(sh(2, R"(if [ "$RANK" = 0 ]; then sleep 0.5; kill -KILL $$; fi
echo "pid $$"; exec sleep 60)"));
  int code = run.finish();
  EXPECT_EQ(code, 128 + SIGKILL) << run.err();
  EXPECT_LT(run.elapsed_s(), 4.0)
      << "SIGTERM should stop the other ranks well before the 5 s grace";
  EXPECT_NE(run.err().find("dtrun: rank 0 was killed by signal 9"), std::string::npos) << run.err();
  auto pids = printed_pids(run.out());
  EXPECT_EQ(pids.size(), 1u) << run.out();
  expect_all_gone(pids);
}

TEST(Dtrun, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  Dtrun run(sh(2, R"(if [ "$RANK" = 1 ]; then sleep 1; exit 5; fi
trap '' TERM; echo "pid $$"; exec sleep 60)",
               {"--grace", "1"}));
  int code = run.finish();
  EXPECT_EQ(code, 5) << run.err();
  EXPECT_GE(run.elapsed_s(), 1.9) << "SIGKILL came before the grace period ended";
  EXPECT_LT(run.elapsed_s(), 10.0);
  expect_all_gone(printed_pids(run.out()));
}

TEST(Dtrun, SigtermToDtrunIsForwardedToEveryRank) {
  Dtrun run(sh(2, R"(echo "pid $$"; exec sleep 60)"));
  ASSERT_TRUE(run.wait_for("pid", 2)) << run.out() << run.err();
  run.signal(SIGTERM);
  auto sent = Clock::now();
  EXPECT_EQ(run.finish(), 128 + SIGTERM) << run.err();
  EXPECT_LT(seconds_since(sent), 4.0) << "the ranks should die of the forwarded SIGTERM";
  expect_all_gone(printed_pids(run.out()));
}

TEST(Dtrun, SecondCtrlCKillsRanksThatIgnoreTheFirst) {
  Dtrun run(sh(2, R"(trap '' INT TERM; echo "pid $$"; exec sleep 60)", {"--grace", "60"}));
  ASSERT_TRUE(run.wait_for("pid", 2)) << run.out() << run.err();
  run.signal(SIGINT);
  ASSERT_TRUE(run.wait_for("got SIGINT")) << run.err();
  run.signal(SIGINT);
  auto sent = Clock::now();
  EXPECT_EQ(run.finish(), 128 + SIGINT) << run.err();
  EXPECT_LT(seconds_since(sent), 5.0);
  expect_all_gone(printed_pids(run.out()));
}

TEST(Dtrun, ProcessesLeftRunningBySuccessfulRanksAreStopped) {
  // One background process keeps the rank's stdout pipe open, the other does not.
  Dtrun run(sh(2, R"(if [ "$RANK" = 0 ]; then sleep 60 & else sleep 60 >/dev/null 2>&1 & fi
echo "pid $!")"));
  EXPECT_EQ(run.finish(), 0) << run.err();
  EXPECT_LT(run.elapsed_s(), 4.0) << "leftovers should get SIGTERM, not wait for the grace period";
  auto pids = printed_pids(run.out());
  EXPECT_EQ(pids.size(), 2u) << run.out();
  expect_all_gone(pids);
}

bool mpirun_on_path() { return std::system("command -v mpirun > /dev/null 2>&1") == 0; }

// --backend mpi: mpirun starts the ranks and tags their output; dtrun turns the tags back into
// "[rank R] " lines, carriage returns (progress bars) included, also when a tag arrives mid-line.
TEST(DtrunMpi, OutputIsSplitBackIntoPrefixedLinesPerRank) {
  if (!mpirun_on_path()) GTEST_SKIP() << "mpirun is not on PATH";
  Dtrun run(sh(2, R"(r=$OMPI_COMM_WORLD_RANK
echo "hello from $r"
printf 'step 1 [%s]\r' "$r" >&2; sleep 0.2; printf 'step 2 [%s]\r' "$r" >&2
printf 'half '; sleep 0.3; printf 'line of %s\n' "$r"
printf 'unterminated %s' "$r")",
               {"--backend", "mpi"}));
  ASSERT_EQ(run.finish(60), 0) << run.err();
  const auto lines = lines_of(run.out());
  std::multiset<std::string> out(lines.begin(), lines.end());
  EXPECT_EQ(out, (std::multiset<std::string>{"[rank 0] hello from 0", "[rank 1] hello from 1",
                                             "[rank 0] half line of 0", "[rank 1] half line of 1",
                                             "[rank 0] unterminated 0", "[rank 1] unterminated 1"}))
      << run.out();
  for (int r = 0; r < 2; ++r) {  // each redraw prefixed and kept, in order (ranks interleave)
    const std::string n = std::to_string(r);
    const size_t first = run.err().find("[rank " + n + "] step 1 [" + n + "]\r");
    const size_t second = run.err().find("[rank " + n + "] step 2 [" + n + "]\r");
    EXPECT_NE(first, std::string::npos) << run.err();
    EXPECT_NE(second, std::string::npos) << run.err();
    EXPECT_LT(first, second) << run.err();
  }
  EXPECT_EQ(run.err().find("<stderr>"), std::string::npos) << "mpirun's tags leaked";
}

TEST(DtrunMpi, FailingRankEndsTheJobWithAnError) {
  if (!mpirun_on_path()) GTEST_SKIP() << "mpirun is not on PATH";
  Dtrun run(sh(2, R"(if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then exit 3; fi; sleep 30)",
               {"--backend", "mpi"}));
  const int code = run.finish(60);
  EXPECT_NE(code, 0) << run.err();
  EXPECT_LT(run.elapsed_s(), 20.0) << "mpirun should stop rank 0 when rank 1 fails";
  EXPECT_NE(run.err().find("dtrun: mpirun exited with code"), std::string::npos) << run.err();
}

TEST(DtrunMpi, RanksFailingAlikePrintOneErrorAndNoMpirunBanner) {
  if (!mpirun_on_path()) GTEST_SKIP() << "mpirun is not on PATH";
  Dtrun run(sh(2, R"(echo "prog: error on rank $OMPI_COMM_WORLD_RANK: no model" >&2; exit 1)",
               {"--backend", "mpi"}));
  EXPECT_EQ(run.finish(60), 1) << run.err();
  EXPECT_EQ(lines_of(run.err()),
            (std::vector<std::string>{"dtrun: mpirun exited with code 1",
                                      "prog: error on every rank (2 of 2): no model"}))
      << run.err();
}

TEST(DtrunMpi, MissingProgramFailsWithAnErrorNamingIt) {
  if (!mpirun_on_path()) GTEST_SKIP() << "mpirun is not on PATH";
  Dtrun run({"-n", "2", "--backend", "mpi", "dtrun-test-no-such-program"});
  EXPECT_EQ(run.finish(60), 127);
  EXPECT_EQ(run.err(),
            "dtrun: cannot run 'dtrun-test-no-such-program': No such file or directory (not found "
            "in PATH)\n");
}

TEST(Dtrun, HelpExitsZeroAndPrintsUsage) {
  Dtrun run({"--help"});
  ASSERT_EQ(run.finish(), 0);
  EXPECT_EQ(run.out().rfind("Usage: dtrun -n N", 0), 0u) << run.out();
  for (const char* option : {"--master-addr", "--master-port", "--no-prefix", "--grace"}) {
    EXPECT_NE(run.out().find(option), std::string::npos) << option;
  }
  EXPECT_EQ(run.err(), "");
}

TEST(Dtrun, MissingProgramFailsWithAnErrorNamingIt) {
  Dtrun run({"-n", "2", "dtrun-test-no-such-program", "arg"});
  EXPECT_EQ(run.finish(), 127);
  EXPECT_NE(run.err().find("dtrun: cannot run 'dtrun-test-no-such-program': No such file or "
                           "directory"),
            std::string::npos)
      << run.err();
  EXPECT_EQ(run.out(), "");
}

TEST(Dtrun, UsageErrorsExitTwoWithAMessage) {
  const std::vector<std::vector<std::string>> bad = {
      {},
      {"/bin/true"},
      {"-n", "2"},
      {"-n", "0", "/bin/true"},
      {"-n", "two", "/bin/true"},
      {"--bogus", "-n", "2", "/bin/true"},
      {"-n", "2", "--master-port", "70000", "/bin/true"},
      // several nodes: the node rank in range, the rendezvous named, no mpirun
      {"-n", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1", "--master-port",
       "29500", "/bin/true"},
      {"-n", "2", "--nnodes", "2", "--master-addr", "10.0.0.1", "/bin/true"},
      {"-n", "2", "--nnodes", "2", "--master-port", "29500", "/bin/true"},
      {"-n", "2", "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29500",
       "--backend", "mpi", "/bin/true"}};
  for (const auto& args : bad) {
    Dtrun run(args);
    EXPECT_EQ(run.finish(), 2) << ::testing::PrintToString(args);
    EXPECT_EQ(run.err().rfind("dtrun: ", 0), 0u) << run.err();
  }
}

}  // namespace
