// dtrun: starts N ranks of a program on this machine with torchrun's environment variables,
// prefixes their output with the rank, and stops every rank as soon as one fails.
// Plain POSIX (plus two optional Linux calls); it does not use LibTorch.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "common/local_ranks.h"
#include "line_writer.h"
#include "options.h"
#include "tagged_output.h"

namespace dtrun {
namespace {

namespace launch = dtensor::launch;

using Clock = std::chrono::steady_clock;

// A failing rank's peers get this long to end on their own before dtrun stops them: ranks that
// fail alike (a missing file) then all say why, and their error is printed once.
constexpr auto kPeersFailAlikeWithin = std::chrono::seconds(1);

// Self-pipe: signal handlers write the signal number, the poll loop reads it.
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_signal(int sig) {
  int saved = errno;
  unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

void message(const std::string& text) { write_all(STDERR_FILENO, "dtrun: " + text + "\n"); }

[[noreturn]] void fatal(const std::string& text) {
  message(text);
  std::exit(1);
}

// Why execvp could not run `program` (a path as it is, a bare name searched in PATH), or 0.
int cannot_execute(const std::string& program) {
  if (program.find('/') != std::string::npos) {
    return ::access(program.c_str(), X_OK) == 0 ? 0 : errno;
  }
  const char* path = std::getenv("PATH");
  const std::string dirs = path ? path : "";
  for (size_t start = 0; start <= dirs.size();) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string candidate = dirs.substr(start, end - start) + "/" + program;
    if (end > start && ::access(candidate.c_str(), X_OK) == 0) return 0;
    start = end + 1;
  }
  return ENOENT;
}

// dtrun's message and exit code for a program that cannot be run.
int report_cannot_run(const std::string& program, int error, bool launcher) {
  std::string what = "cannot run '" + program + "': " + std::strerror(error);
  if (error == ENOENT && program.find('/') == std::string::npos) {
    what += launcher ? " (not found in PATH; install Open MPI, scripts/setup does)"
                     : " (not found in PATH)";
  }
  message(what);
  return error == ENOENT ? 127 : 126;
}

bool make_pipe(int fds[2]) {
  if (::pipe(fds) != 0) return false;
  for (int i = 0; i < 2; ++i) ::fcntl(fds[i], F_SETFD, FD_CLOEXEC);
  return true;
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

void install_signal_handlers() {
  if (!make_pipe(g_signal_pipe)) fatal(std::string("pipe failed: ") + std::strerror(errno));
  set_nonblocking(g_signal_pipe[0]);
  set_nonblocking(g_signal_pipe[1]);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : kHandledSignals) ::sigaction(sig, &sa, nullptr);
  // A closed stdout (dtrun ... | head) must not kill dtrun while ranks still run.
  ::signal(SIGPIPE, SIG_IGN);
}

// A process dtrun started: one rank, or mpirun starting all of them.
struct Rank {
  Rank(int index, std::string name, bool prefix)
      : index(index),
        name(std::move(name)),
        out(STDOUT_FILENO, prefix ? "[rank " + std::to_string(index) + "] " : ""),
        err(STDERR_FILENO, prefix ? "[rank " + std::to_string(index) + "] " : "") {
    if (prefix) err.hold_errors_of(index);
  }

  int index;
  std::string name;  // "rank 3" or "mpirun", for messages
  pid_t pid = -1;    // also the id of its process group
  bool reaped = false;
  bool group_gone = false;  // no process of its group is left
  int fds[2] = {-1, -1};    // read ends of its stdout and stderr pipes
  LineWriter out, err;
};

class Launcher {
 public:
  // Forks o_.nproc ranks; or, given `mpirun_command`, runs that one process, which starts the
  // ranks, and splits its tagged output back into the ranks' lines.
  explicit Launcher(Options options, std::vector<std::string> mpirun_command = {})
      : o_(std::move(options)), mpirun_command_(std::move(mpirun_command)) {
    if (!mpirun_command_.empty() && o_.prefix) {
      tagged_ = std::make_unique<TaggedOutput>(o_.nproc, o_.prefix);
    }
  }

  int run() {
    install_signal_handlers();
#ifdef __linux__
    // Orphaned grandchildren are re-parented to us, so we can reap them and know when a rank's
    // process group is really gone.
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
#endif
    if (o_.master_port == 0) {
      try {
        o_.master_port = launch::free_port();
      } catch (const std::system_error& e) {
        fatal(std::string(e.what()) + " (pass --master-port)");
      }
    }
    ::setenv("OMP_NUM_THREADS", "1", /*overwrite=*/0);
    devnull_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull_ < 0) fatal(std::string("cannot open /dev/null: ") + std::strerror(errno));

    const int processes = mpirun_command_.empty() ? o_.nproc : 1;
    ranks_.reserve(processes);
    for (int r = 0; r < processes && !launch_error_; ++r) launch(r);
    if (launch_error_) stop(SIGTERM);

    loop();
    sweep_leftovers();
    print_rank_errors();

    if (launch_error_) return *launch_error_;
    if (failure_) return *failure_;
    if (interrupted_by_) return 128 + interrupted_by_;
    return 0;
  }

 private:
  // Starts rank r. On failure sets launch_error_ (the exit code) after printing why.
  void launch(int r) {
    int out[2] = {-1, -1}, err[2] = {-1, -1};
    const bool by_mpirun = !mpirun_command_.empty();
    const std::vector<std::string>& command = by_mpirun ? mpirun_command_ : o_.command;
    launch::ChildSetup setup;
    // mpirun passes the rendezvous variables on with -x; RANK in its own environment would
    // reach every rank and override Open MPI's.
    if (!by_mpirun) setup.env = rank_env(r);
    setup.stdin_fd = devnull_;
    setup.own_process_group = true;
    // If dtrun itself is killed (SIGKILL cannot be forwarded), take the rank down with it.
    setup.die_with_parent = true;
    launch::Spawned child;
    try {
      if (!make_pipe(out) || !make_pipe(err))
        throw std::system_error(errno, std::generic_category());
      setup.stdout_fd = out[1];
      setup.stderr_fd = err[1];
      child = launch::spawn_program(command, setup);
    } catch (const std::system_error& e) {
      message("cannot start " +
              (by_mpirun ? std::string("mpirun")
                         : "rank " + std::to_string(o_.node_rank * o_.nproc + r)) +
              ": " + e.code().message());
      for (int fd : {out[0], out[1], err[0], err[1]}) {
        if (fd >= 0) ::close(fd);
      }
      launch_error_ = 1;
      return;
    }
    const int global = o_.node_rank * o_.nproc + r;
    Rank& rank = ranks_.emplace_back(
        global, by_mpirun ? "mpirun" : "rank " + std::to_string(global), o_.prefix && !by_mpirun);
    rank.pid = child.pid;
    rank.fds[0] = out[0];
    rank.fds[1] = err[0];
    set_nonblocking(out[0]);
    set_nonblocking(err[0]);
    ::close(out[1]);
    ::close(err[1]);
    if (child.exec_errno != 0) {
      launch_error_ = report_cannot_run(command[0], child.exec_errno, by_mpirun);
    }
  }

  // torchrun's variables for local rank r of this node.
  launch::Env rank_env(int r) const {
    launch::Env env = launch::rank_env(o_.node_rank * o_.nproc + r, o_.nnodes * o_.nproc,
                                       o_.master_port, o_.master_addr);
    for (auto& [key, value] : env) {
      if (key == "LOCAL_RANK") value = std::to_string(r);
      if (key == "LOCAL_WORLD_SIZE") value = std::to_string(o_.nproc);
    }
    env.emplace_back("GROUP_RANK", std::to_string(o_.node_rank));
    return env;
  }

  // Signals every rank's process group that may still have processes.
  void signal_groups(int sig) {
    for (Rank& r : ranks_) {
      if (r.group_gone) continue;
      if (::kill(-r.pid, sig) != 0 && errno == ESRCH) r.group_gone = true;
    }
  }

  // Starts stopping all ranks with `sig`; SIGKILL follows after the grace period.
  void stop(int sig) {
    if (!stopping_) {
      stopping_ = true;
      kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(o_.grace_s));
    }
    signal_groups(sig);
  }

  void kill_all() {
    signal_groups(SIGKILL);
    killed_ = true;
    kill_at_.reset();
    // Whoever still holds a pipe after this is outside our process groups: stop waiting for it.
    give_up_at_ = Clock::now() + std::chrono::seconds(2);
  }

  bool all_reaped() const { return std::ranges::all_of(ranks_, &Rank::reaped); }

  // The error lines the ranks ended with, each distinct one once (rank_errors.h).
  void print_rank_errors() {
    std::vector<RankError> errors;
    const auto add = [&](std::optional<RankError> e) {
      if (e) errors.push_back(std::move(*e));
    };
    if (tagged_) {
      for (int r = 0; r < o_.nproc; ++r) add(tagged_->take_held_error(r));
    } else {
      for (Rank& r : ranks_) add(r.err.take_held_error());
    }
    for (const std::string& line : summarize_rank_errors(errors, o_.nnodes * o_.nproc, o_.prefix))
      write_all(STDERR_FILENO, line + "\n");
  }

  bool any_pipe_open() const {
    return std::ranges::any_of(ranks_,
                               [](const Rank& r) { return r.fds[0] >= 0 || r.fds[1] >= 0; });
  }

  void reap() {
    int status = 0;
    pid_t pid;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      for (Rank& r : ranks_) {
        if (r.pid != pid) continue;
        r.reaped = true;
        bool failed = WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
        if (failed && !stopping_ && !failure_) {
          failure_ = launch::exit_code_of(status);
          failure_text_ = r.name + " " + launch::describe_status(status);
          stop_others_at_ = Clock::now() + kPeersFailAlikeWithin;
        }
      }
    }
  }

  // Once the first failure's window has passed (or no rank is left), says which rank failed and
  // stops the others.
  void stop_after_failure(Clock::time_point now) {
    if (!stop_others_at_ || (now < *stop_others_at_ && !all_reaped())) return;
    stop_others_at_.reset();
    const bool others = !all_reaped() && !stopping_;
    message(failure_text_ + (others ? "; stopping the other ranks" : ""));
    if (others) stop(SIGTERM);
  }

  void on_dtrun_signal(int sig) {
    if (sig == SIGCHLD) return;  // reaped at the top of the loop
    if (interrupted_by_ == 0) {
      interrupted_by_ = sig;
      const char* name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGHUP";
      message(std::string("got ") + name + "; passing it on to the ranks" +
              (sig == SIGINT ? " (press Ctrl-C again to kill them)" : ""));
      stop(sig);
    } else if (!killed_) {
      message("killing the ranks");
      kill_all();
    }
  }

  void close_stream(Rank& r, int which) {
    if (tagged_) {
      tagged_->finish(which);
    } else {
      (which == 0 ? r.out : r.err).finish();
    }
    ::close(r.fds[which]);
    r.fds[which] = -1;
  }

  void read_stream(Rank& r, int which) {
    char buf[65536];
    ssize_t n = ::read(r.fds[which], buf, sizeof buf);
    if (n > 0 && tagged_) {
      tagged_->feed(which, buf, static_cast<size_t>(n));
    } else if (n > 0) {
      (which == 0 ? r.out : r.err).feed(buf, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      close_stream(r, which);
    }
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<std::pair<Rank*, int>> owners;
    std::optional<Clock::time_point> linger_until;
    while (true) {
      reap();
      const auto now = Clock::now();
      stop_after_failure(now);
      if (kill_at_ && now >= *kill_at_) kill_all();
      if (give_up_at_ && now >= *give_up_at_) {
        for (Rank& r : ranks_) {
          for (int w = 0; w < 2; ++w) {
            if (r.fds[w] >= 0) close_stream(r, w);
          }
        }
        give_up_at_.reset();
      }
      bool reaped = all_reaped();
      bool open = any_pipe_open();
      if (reaped && !open) break;
      if (reaped && !stopping_) {
        // Every rank exited but something they started still holds their output pipes.
        if (!linger_until) linger_until = now + std::chrono::seconds(1);
        if (now >= *linger_until) {
          message("all ranks exited; stopping processes they left running");
          stop(SIGTERM);
        }
      }

      std::optional<Clock::time_point> wake;
      for (auto t :
           {kill_at_, give_up_at_, stop_others_at_, stopping_ ? std::nullopt : linger_until}) {
        if (t && (!wake || *t < *wake)) wake = t;
      }
      int timeout_ms = -1;
      if (wake) {
        auto ms = std::chrono::ceil<std::chrono::milliseconds>(*wake - now).count();
        timeout_ms = static_cast<int>(std::max<long long>(0, ms));
      }

      fds.clear();
      owners.clear();
      fds.push_back({g_signal_pipe[0], POLLIN, 0});
      owners.emplace_back(nullptr, 0);
      for (Rank& r : ranks_) {
        for (int w = 0; w < 2; ++w) {
          if (r.fds[w] < 0) continue;
          fds.push_back({r.fds[w], POLLIN, 0});
          owners.emplace_back(&r, w);
        }
      }
      if (::poll(fds.data(), static_cast<nfds_t>(fds.size()), timeout_ms) < 0) {
        if (errno == EINTR) continue;
        fatal(std::string("poll failed: ") + std::strerror(errno));
      }
      for (size_t i = 0; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL))) continue;
        if (owners[i].first == nullptr) {
          unsigned char sigs[64];
          ssize_t n = ::read(g_signal_pipe[0], sigs, sizeof sigs);
          for (ssize_t k = 0; k < n; ++k) on_dtrun_signal(sigs[k]);
        } else {
          read_stream(*owners[i].first, owners[i].second);
        }
      }
    }
  }

  // Processes a rank left behind without our pipes (e.g. `cmd > /dev/null &`) are still in its
  // process group: stop them too, so dtrun never leaves anything running.
  void sweep_leftovers() {
    auto wait_gone = [&](std::chrono::duration<double> limit) {
      const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(limit);
      while (true) {
        while (::waitpid(-1, nullptr, WNOHANG) > 0) {
        }
        signal_groups(0);
        const bool gone = std::ranges::all_of(ranks_, &Rank::group_gone);
        if (gone || Clock::now() >= until) return gone;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    };
    if (wait_gone(std::chrono::milliseconds(0))) return;
    if (!killed_) {
      if (!stopping_) message("all ranks exited; stopping processes they left running");
      signal_groups(SIGTERM);
      if (wait_gone(std::chrono::duration<double>(o_.grace_s))) return;
    }
    signal_groups(SIGKILL);
    if (!wait_gone(std::chrono::seconds(5))) {
      message("some processes of the ranks' process groups did not exit after SIGKILL");
    }
  }

  Options o_;
  std::vector<std::string> mpirun_command_;
  std::unique_ptr<TaggedOutput> tagged_;
  int devnull_ = -1;
  std::vector<Rank> ranks_;
  bool stopping_ = false;
  bool killed_ = false;
  std::optional<Clock::time_point> kill_at_;
  std::optional<Clock::time_point> give_up_at_;
  std::optional<int> launch_error_;
  std::optional<int> failure_;
  std::string failure_text_;  // "rank 1 exited with code 3"
  std::optional<Clock::time_point> stop_others_at_;
  int interrupted_by_ = 0;
};

}  // namespace
// "mpi" when this build has the MPI backend and mpirun is on PATH (shared-memory collectives
// beat Gloo's loopback TCP at every size measured, docs/PERFORMANCE.md), else "gloo". Not for
// one rank (nothing to communicate, and mpirun costs a start-up), nor for more ranks than
// cores: MPI ranks poll while they wait, and oversubscribed they take the CPU from each other.
std::string fastest_backend([[maybe_unused]] int nproc) {
#ifdef DTRUN_HAS_MPI
  const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
  if (nproc < 2 || (cores > 0 && nproc > cores)) return "gloo";
  if (cannot_execute("mpirun") == 0) return "mpi";
#endif
  return "gloo";
}

// MPI ranks must be started by the MPI launcher: the mpirun command line that starts the job
// with the same rendezvous variables the forked ranks get. --quiet: a failing rank's own error
// line says why, without Open MPI's banners about the job's end after it (--quiet also
// silences mpirun's message for a program it cannot run: dtrun checks that first).
std::vector<std::string> mpirun_command(Options& o) {
  if (o.master_port == 0) o.master_port = launch::free_port();
  std::vector<std::string> args = {"mpirun", "-np", std::to_string(o.nproc), "--oversubscribe",
                                   "--quiet"};
  if (::geteuid() == 0) args.push_back("--allow-run-as-root");
  const char* threads = std::getenv("OMP_NUM_THREADS");
  for (const std::string& var :
       std::vector<std::string>{std::string("DTENSOR_BACKEND=mpi"), "MASTER_ADDR=" + o.master_addr,
                                "MASTER_PORT=" + std::to_string(o.master_port),
                                std::string("OMP_NUM_THREADS=") + (threads ? threads : "1")}) {
    args.insert(args.end(), {"-x", var});
  }
  if (o.prefix) args.push_back("--tag-output");
  args.insert(args.end(), o.command.begin(), o.command.end());
  return args;
}

}  // namespace dtrun

int main(int argc, char** argv) {
  int exit_code = 0;
  auto options = dtrun::parse_args(argc, argv, exit_code);
  if (!options) return exit_code;
  if (options->backend.empty()) {
    const char* from_env = std::getenv("DTENSOR_BACKEND");
    options->backend = from_env && *from_env ? from_env : "auto";
  }
  if (options->backend == "auto") {
    // mpirun would start this node's ranks only: several nodes meet over Gloo.
    options->backend = options->nnodes > 1 ? "gloo" : dtrun::fastest_backend(options->nproc);
  }
  std::vector<std::string> mpirun;
  if (options->backend == "mpi") {
    // mpirun --quiet would not say why it cannot start the program.
    if (const int error = dtrun::cannot_execute(options->command[0]))
      return dtrun::report_cannot_run(options->command[0], error, /*launcher=*/false);
    mpirun = dtrun::mpirun_command(*options);
  } else if (!options->backend.empty()) {
    ::setenv("DTENSOR_BACKEND", options->backend.c_str(), 1);
  }
  return dtrun::Launcher(std::move(*options), std::move(mpirun)).run();
}
