// Faults at rendezvous and during collectives: every rank must end within the timeout (a few
// seconds here) with a message naming the rank, the collective and, where ranks disagree, the
// first collective whose fingerprints differ. No rank may hang, none may fail alone.
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <thread>

#include "common/local_ranks.h"
#include "dtensor/comm/failure.h"
#include "dtensor/dtensor.h"
#include "support/errors.h"
#include "support/rank_outcomes.h"
#include "support/temp_dir.h"
#include "support/timing.h"

using namespace dtensor;
using dtensor::testing::describe_outcomes;
using dtensor::testing::now;
using dtensor::testing::RankOutcome;
using dtensor::testing::run_ranks_collect;
using dtensor::testing::seconds_since;

namespace {

constexpr double kTimeout = 3.0;  // comm timeout of every test here, seconds
// Before these faults were handled, ranks hung for minutes: stop them well before.
const dtensor::testing::RunOptions kOpts{.timeout = std::chrono::seconds(15),
                                         .comm_timeout = std::chrono::seconds(3)};
// Rendezvous faults: joining gives up after `connect` (3 s unless a test needs every started
// rank to arrive, which a loaded machine can delay past 3 s).
dtensor::testing::RunOptions no_init(std::chrono::seconds connect = std::chrono::seconds(3)) {
  auto o = kOpts;
  o.init_process_group = false;
  o.connect_timeout = connect;
  return o;
}
// For tests whose fault shows once every started rank has joined: far above how long they
// take, so a test passing under it shows the fault ended the rendezvous, not the bound.
constexpr auto kArrivalBound = std::chrono::seconds(30);
constexpr double kFaultSeenWithin = 10.0;

// Rank `rank` of a job whose store rank 0 hosts at `port` (as without torchrun's agent).
void claim(int rank, int world_size, int port) {
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
}

// Whether something listens on 127.0.0.1:`port`.
bool accepts_connections(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// DTENSOR_TEST_TRACE=1 prints how every rank ended, also when the test passes.
std::vector<RankOutcome> traced(std::vector<RankOutcome> out) {
  if (std::getenv("DTENSOR_TEST_TRACE")) std::fprintf(stderr, "%s", describe_outcomes(out).c_str());
  return out;
}

bool exited(const RankOutcome& o, int code) {
  return !o.hung && WIFEXITED(o.status) && WEXITSTATUS(o.status) == code;
}

// No rank hangs or outlives the timeout by much; every rank that ends with a message names
// `divergence`, and one does. (Gloo may abort a rank that receives more bytes than it expects:
// that rank leaves no message of its own.)
void expect_divergence_named(const std::vector<RankOutcome>& out, const std::string& divergence) {
  bool named = false;
  for (const auto& o : out) {
    EXPECT_FALSE(o.hung) << describe_outcomes(out);
    EXPECT_LT(o.seconds, kTimeout + 2.0) << describe_outcomes(out);
    if (o.message.empty()) continue;
    EXPECT_CONTAINS(o.message, divergence);
    named = true;
  }
  EXPECT_TRUE(named) << describe_outcomes(out);
}

// A loop of all_reduces on the world; `fault(i)` runs on every rank before collective i+1.
void loop(int iterations, const std::function<void(int)>& fault) {
  auto& g = *comm::world_group();
  for (int i = 0; i < iterations; ++i) {
    fault(i);
    comm::all_reduce(at::ones({4}), ReduceOp::Sum, g);
  }
}

}  // namespace

// ---- rendezvous ------------------------------------------------------------------------------

TEST(RendezvousFaults, RankWithoutRankZeroFailsWithinTheTimeoutNamingRankZero) {
  const int port = dtensor::launch::free_port();
  auto out = traced(run_ranks_collect(
      1,
      [port](int) {
        claim(1, 2, port);
        auto t0 = now();
        const std::string msg = dtensor::testing::message_of([] { comm::init_process_group(); });
        EXPECT_CONTAINS(msg,
                        "rank 1: no rank 0 at 127.0.0.1:" + std::to_string(port) + " after 3 s");
        EXPECT_LT(seconds_since(t0), kTimeout + 1.0);
      },
      no_init()));
  EXPECT_TRUE(exited(out[0], 0)) << describe_outcomes(out);
}

TEST(RendezvousFaults, WorldSizeMismatchIsNamedOnEveryRank) {
  const int port = dtensor::launch::free_port();
  auto out = traced(run_ranks_collect(
      2,
      [port](int rank) {
        claim(rank, rank == 0 ? 2 : 3, port);
        auto t0 = now();
        const std::string msg = dtensor::testing::message_of([] { comm::init_process_group(); });
        EXPECT_CONTAINS(msg, "WORLD_SIZE mismatch: rank ");
        EXPECT_CONTAINS(msg, "says 2");
        EXPECT_CONTAINS(msg, "says 3");
        EXPECT_LT(seconds_since(t0), kFaultSeenWithin);
      },
      no_init(kArrivalBound)));
  EXPECT_TRUE(exited(out[0], 0) && exited(out[1], 0)) << describe_outcomes(out);
}

// Rank 0 hosts the store: when rank 2 never comes, rank 1 must not die with the store's bare
// "connection reset" when rank 0 gives up first; every rank names rank 2.
TEST(RendezvousFaults, EveryRankNamesTheRankThatNeverCame) {
  const int port = dtensor::launch::free_port();
  auto out = traced(run_ranks_collect(
      2,
      [port](int rank) {
        claim(rank, 3, port);
        auto t0 = now();
        const std::string msg = dtensor::testing::message_of([] { comm::init_process_group(); });
        EXPECT_CONTAINS(msg, "could not rendezvous with 3 ranks");
        EXPECT_CONTAINS(msg, "within 6 s");
        EXPECT_CONTAINS(msg, "missing rank(s): 2 (never started");
        EXPECT_LT(seconds_since(t0), 6 + 2.5);
      },
      // Ranks 0 and 1 must both have joined by then to be told apart from rank 2.
      no_init(std::chrono::seconds(6))));
  EXPECT_TRUE(exited(out[0], 0) && exited(out[1], 0)) << describe_outcomes(out);
}

TEST(RendezvousFaults, TwoProcessesClaimingOneRankAllFailNamingBoth) {
  // Processes 1 and 2 both say RANK=1 in a world of 2; whichever pair gets going fails too.
  auto out = traced(run_ranks_collect(
      3,
      [](int p) {
        ::setenv("RANK", p == 0 ? "0" : "1", 1);
        ::setenv("WORLD_SIZE", "2", 1);
        comm::init_process_group();
        loop(40, [](int) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); });
        comm::destroy_process_group();
      },
      no_init(kArrivalBound)));
  for (size_t p = 0; p < out.size(); ++p) {
    EXPECT_TRUE(exited(out[p], 2)) << describe_outcomes(out);
    EXPECT_CONTAINS(out[p].message, "rank 1 joined twice (pid ");
    EXPECT_LT(out[p].seconds, kFaultSeenWithin) << describe_outcomes(out);
  }
}

// Rank 1 joins while the store's host (rank 0) is frozen for 4.5 s, longer than the 3 s comm
// timeout, as a loaded machine may deschedule it: joining is bounded by the connect bound (30 s),
// so both ranks go on, and a collective then still has the short timeout.
TEST(RendezvousFaults, AStoreHostSlowerThanTheTimeoutIsWaitedForUpToTheConnectBound) {
  const int port = dtensor::launch::free_port();
  dtensor::testing::TempDir dir;
  const std::string pid_file = dir.file("rank0.pid");
  auto out = traced(run_ranks_collect(
      2,
      [&](int rank) {
        claim(rank, 2, port);
        if (rank == 0) {
          std::ofstream(pid_file) << ::getpid();
        } else {
          pid_t host = 0;
          while (!accepts_connections(port) || !(std::ifstream(pid_file) >> host)) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
          ::kill(host, SIGSTOP);
          std::thread resume([host] {
            std::this_thread::sleep_for(std::chrono::milliseconds(4500));
            ::kill(host, SIGCONT);
          });
          resume.detach();
        }
        comm::init_process_group();
        loop(3, [](int) {});
        comm::destroy_process_group();
      },
      no_init(kArrivalBound)));
  EXPECT_TRUE(exited(out[0], 0) && exited(out[1], 0)) << describe_outcomes(out);
}

// ---- collectives -----------------------------------------------------------------------------

// Rank 1 throws `what` before collective `at`+1 while rank 0 reaches it `delay_ms` later; rank
// 0 must end within 2 s of rank 1, naming rank 1 and its error.
std::vector<RankOutcome> rank1_throws(int at, int delay_ms, const std::string& what) {
  auto out = traced(run_ranks_collect(
      2,
      [=](int rank) {
        loop(10, [=](int i) {
          if (rank == 1 && i == at) throw std::runtime_error(what);
          if (rank == 0 && i == at)
            std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        });
      },
      kOpts));
  EXPECT_TRUE(exited(out[1], 2)) << describe_outcomes(out);
  EXPECT_TRUE(exited(out[0], 2)) << describe_outcomes(out);
  EXPECT_CONTAINS(out[0].message, "rank 1 failed: rank 1 threw: " + what);
  EXPECT_LT(out[0].seconds - out[1].seconds, 2.0) << describe_outcomes(out);
  return out;
}

TEST(CollectiveFaults, ExceptionOnOneRankStopsTheOthersNamingItAndTheirCollective) {
  auto out = rank1_throws(5, 50, "boom on rank 1 only");
  EXPECT_CONTAINS(out[0].message, "rank 0: all_reduce float32[4]");
  EXPECT_CONTAINS(out[0].message, "collective #6 on group world");
}

TEST(CollectiveFaults, ExceptionOutsideCollectivesStopsAPeerBusyComputing) {
  // Rank 0 is computing when rank 1 fails: its next collective must not even start.
  auto out = rank1_throws(3, 800, "rank 1 ran out of data");
  EXPECT_CONTAINS(out[0].message,
                  "all_reduce float32[4] (collective #4 on group world) not started");
}

TEST(CollectiveFaults, KilledRankIsNamedByTheOthersWithinTwoSeconds) {
  auto out = traced(run_ranks_collect(
      2,
      [](int rank) {
        loop(50, [rank](int i) {
          if (rank == 1 && i == 10) ::raise(SIGKILL);
        });
      },
      kOpts));
  ASSERT_TRUE(!out[1].hung && WIFSIGNALED(out[1].status)) << describe_outcomes(out);
  EXPECT_TRUE(exited(out[0], 2)) << describe_outcomes(out);
  EXPECT_CONTAINS(out[0].message, "rank 0: all_reduce float32[4]");
  EXPECT_CONTAINS(out[0].message, "collective #11 on group world");
  EXPECT_CONTAINS(out[0].message, "rank 1 did not answer");
  EXPECT_LT(out[0].seconds - out[1].seconds, 2.0) << describe_outcomes(out);
}

TEST(CollectiveFaults, StoppedRankIsNamedWithinTheTimeoutAndEndsWhenContinued) {
  constexpr double kStopped = 6.0;  // seconds rank 1 stays stopped
  auto out = traced(run_ranks_collect(
      2,
      [](int rank) {
        loop(10, [rank](int i) {
          if (rank != 1 || i != 5) return;
          if (::fork() == 0) {  // wakes rank 1 up again later
            ::usleep(static_cast<useconds_t>(kStopped * 1e6));
            ::kill(::getppid(), SIGCONT);
            ::_exit(0);
          }
          ::raise(SIGSTOP);
        });
      },
      kOpts));
  EXPECT_TRUE(exited(out[0], 2)) << describe_outcomes(out);
  EXPECT_CONTAINS(out[0].message, "rank 0: all_reduce float32[4]");
  EXPECT_CONTAINS(out[0].message, "collective #6 on group world");
  EXPECT_CONTAINS(out[0].message, "rank 1 did not answer");
  // Within the timeout: the backend waits the timeout less the time the diagnosis may take.
  EXPECT_LT(out[0].seconds, kTimeout + 0.5) << describe_outcomes(out);
  // Continued, rank 1 learns of rank 0's failure at its next collective.
  EXPECT_TRUE(exited(out[1], 2)) << describe_outcomes(out);
  EXPECT_CONTAINS(out[1].message, "rank 0 failed");
  EXPECT_LT(out[1].seconds, kStopped + 2.0) << describe_outcomes(out);
}

TEST(CollectiveFaults, SkippedCollectiveNamesTheFirstDivergentFingerprint) {
  auto out = traced(run_ranks_collect(
      2,
      [](int rank) {
        auto& g = *comm::world_group();
        for (int i = 0; i < 8; ++i) {
          if (rank == 1 && i == 5) continue;  // rank 1 skips collective #6
          comm::all_reduce(at::ones({4}), ReduceOp::Sum, g);
        }
        comm::all_gather_into_tensor(at::ones({4}), 0, g);
        comm::destroy_process_group();
      },
      kOpts));
  expect_divergence_named(out,
                          "ranks diverge at collective #8 on group world: rank 0 "
                          "all_reduce float32[4], rank 1 all_gather_into_tensor float32[4]");
}

TEST(CollectiveFaults, CheckModeNamesADifferentShapeBeforeIssuingIt) {
  ::setenv("DTENSOR_CHECK_COLLECTIVES", "1", 1);
  auto out = traced(run_ranks_collect(
      2,
      [](int rank) {
        auto& g = *comm::world_group();
        for (int i = 0; i < 8; ++i) {
          const int64_t n = rank == 1 && i == 5 ? 8 : 4;  // same numel would pass unnoticed
          comm::all_reduce(at::ones({n / 4, 4}), ReduceOp::Sum, g);
        }
      },
      kOpts));
  ::unsetenv("DTENSOR_CHECK_COLLECTIVES");
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(exited(out[r], 2)) << describe_outcomes(out);
    EXPECT_CONTAINS(out[r].message,
                    "ranks diverge at collective #6 on group world: rank 0 "
                    "all_reduce float32[1,4], rank 1 all_reduce float32[2,4]");
    EXPECT_LT(out[r].seconds, 2.0) << describe_outcomes(out);
  }
}

TEST(CollectiveFaults, DifferentShapeWithoutCheckModeNeverHangs) {
  auto out = traced(run_ranks_collect(
      2,
      [](int rank) {
        auto& g = *comm::world_group();
        for (int i = 0; i < 8; ++i) {
          comm::all_reduce(at::ones({rank == 1 && i == 5 ? 8 : 4}), ReduceOp::Sum, g);
        }
        comm::destroy_process_group();
      },
      kOpts));
  expect_divergence_named(out,
                          "ranks diverge at collective #6 on group world: rank 0 "
                          "all_reduce float32[4], rank 1 all_reduce float32[8]");
}

TEST(CollectiveFaults, NormalExitAtDifferentTimesDoesNotFire) {
  auto out = traced(run_ranks_collect(
      2,
      [](int rank) {
        loop(5, [](int) {});
        if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(700));
        comm::destroy_process_group();
      },
      kOpts));
  EXPECT_TRUE(exited(out[0], 0) && exited(out[1], 0)) << describe_outcomes(out);
}

// Rank 1 reports a failure after two collectives and lingers `linger_ms`; rank 0 then runs
// `next`.
std::vector<RankOutcome> rank1_reports_failure(const std::function<void()>& next,
                                               int linger_ms = 1500) {
  return traced(run_ranks_collect(
      2,
      [&next, linger_ms](int rank) {
        loop(2, [](int) {});
        if (rank == 1) {
          comm::report_failure("rank 1 gave up on purpose");
          std::this_thread::sleep_for(std::chrono::milliseconds(linger_ms));
          return;
        }
        next();
      },
      kOpts));
}

TEST(CollectiveFaults, ReportFailureStopsAPeerInABarrier) {
  auto out = rank1_reports_failure([] { comm::barrier(); });
  EXPECT_TRUE(exited(out[1], 0)) << describe_outcomes(out);
  EXPECT_TRUE(exited(out[0], 2)) << describe_outcomes(out);
  EXPECT_CONTAINS(out[0].message, "barrier not started: rank 1 failed: rank 1 gave up on purpose");
  EXPECT_LT(out[0].seconds, 1.5) << describe_outcomes(out);
}

// The rank that failed starts no further collective itself, whenever its peers read the
// notice: before, its next all_reduce ran with a peer that had not polled the store yet, and the
// notice ended some later collective instead, one the watchdog's timing chose.
TEST(CollectiveFaults, AFailedRanksNextCollectiveFailsAtOnceOnItAndItsPeers) {
  auto out = traced(run_ranks_collect(
      2,
      [](int rank) {
        loop(2, [](int) {});
        if (rank == 1) comm::report_failure("rank 1 gave up on purpose");
        comm::all_reduce(at::ones({4}), ReduceOp::Sum, *comm::world_group());
      },
      kOpts));
  EXPECT_TRUE(exited(out[0], 2) && exited(out[1], 2)) << describe_outcomes(out);
  EXPECT_CONTAINS(out[1].message,
                  "all_reduce float32[4] (collective #3 on group world) not started: rank 1 "
                  "failed: rank 1 gave up on purpose");
  EXPECT_CONTAINS(out[0].message, "rank 1 failed: rank 1 gave up on purpose");
}

// A receive that a failure stops before it starts names its end of the channel and the peer.
TEST(CollectiveFaults, AMessageNotStartedNamesItsDirectionAndPeer) {
  // The watchdog sees the report within a few hundred milliseconds when idle; 3 s keeps that
  // true on a loaded machine (800 ms did not, beside ctest -j2 and a spinning process), and rank
  // 1 stays until after it, so that the receive meets the report and not a closed connection.
  auto out = rank1_reports_failure(
      [] {
        std::this_thread::sleep_for(std::chrono::milliseconds(3000));
        comm::recv(at::ones({4}), 1, *comm::world_group());
      },
      /*linger_ms=*/5000);
  EXPECT_TRUE(exited(out[0], 2)) << describe_outcomes(out);
  EXPECT_CONTAINS(out[0].message,
                  "recv float32[4] from global rank 1 (message #1 on channel world:1->0) not "
                  "started: rank 1 failed: rank 1 gave up on purpose");
}

// Rank 1 waits in a collective on group {0, 1} that rank 0 has not issued, because rank 0 itself
// waits on group {0, 2} for rank 2, which is busy elsewhere (as a TP rank waits for its FSDP
// peer across a dead link): rank 1's message goes past "rank 0 is behind" to what rank 0 waits
// in and who is missing there. Rank 1 must give up (5 s after it starts waiting: a 6 s comm
// timeout less the diagnosis budget) while rank 0 still waits (from 2.5 s to 7.5 s): 2.5 s of
// margin either side, which a loaded machine's scheduling keeps (0.3 s did not, in CI).
TEST(CollectiveFaults, PeerBehindIsFollowedToTheCollectiveItWaitsInAndTheRankMissingThere) {
  auto opts = kOpts;
  opts.timeout = std::chrono::seconds(40);
  opts.comm_timeout = std::chrono::seconds(6);
  auto out = traced(run_ranks_collect(
      3,
      [](int rank) {
        auto a = comm::new_group({0, 1});
        auto b = comm::new_group({0, 2});
        if (a) comm::all_reduce(at::ones({4}), ReduceOp::Sum, *a);
        if (b) comm::all_reduce(at::ones({4}), ReduceOp::Sum, *b);
        comm::barrier();
        if (rank == 1) comm::all_reduce(at::ones({4}), ReduceOp::Sum, *a);
        if (rank == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          comm::all_reduce(at::ones({3}), ReduceOp::Sum, *b);
        }
        if (rank == 2) {
          std::this_thread::sleep_for(std::chrono::seconds(12));  // busy outside collectives
          comm::all_reduce(at::ones({3}), ReduceOp::Sum, *b);
        }
      },
      opts));
  EXPECT_TRUE(exited(out[1], 2)) << describe_outcomes(out);
  EXPECT_CONTAINS(out[1].message, "rank 0 has issued only 1 collectives on group group0[0,1]");
  EXPECT_CONTAINS(out[1].message,
                  "rank 0 is itself waiting in collective #2 all_reduce float32[3] on group "
                  "group1[0,2]: rank 2 has issued only 1 collectives on group group1[0,2] while "
                  "rank 0 waits in #2 all_reduce float32[3]");
  for (const auto& o : out) EXPECT_FALSE(o.hung) << describe_outcomes(out);
}

// ---- what a person reads ---------------------------------------------------------------------

// An uncaught error in a rank prints its message once, without LibTorch's C++ stack trace or
// libstdc++'s "terminate called after throwing", and the other ranks name it the same way.
TEST(CollectiveFaults, UncaughtErrorIsOneMessageWithoutAStackTrace) {
  dtensor::testing::TempDir dir;
  const std::string err_file = dir.file("rank1.stderr");
  auto out = traced(run_ranks_collect(
      2,
      [&err_file](int rank) {
        loop(3, [&err_file, rank](int i) {
          if (rank != 1 || i != 2) return;
          const int fd = ::open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
          ::dup2(fd, STDERR_FILENO);
          std::thread([] { TORCH_CHECK(false, "injected uncaught failure"); }).join();
        });
      },
      kOpts));
  std::ifstream in(err_file);
  const std::string printed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_CONTAINS(printed, "dtensor: rank 1 failed: uncaught exception: injected uncaught failure");
  for (const auto& text : {printed, out[0].message}) {
    EXPECT_EQ(text.find("terminate called"), std::string::npos) << text;
    EXPECT_EQ(text.find("frame #"), std::string::npos) << text;
    EXPECT_EQ(text.find("Exception raised from"), std::string::npos) << text;
  }
  EXPECT_TRUE(exited(out[0], 2)) << describe_outcomes(out);
  EXPECT_CONTAINS(out[0].message, "rank 1 failed: uncaught exception: injected uncaught failure");
}
