// bench_redistribute: what redistribute() costs on top of the collective it issues.
//
//   build/bench/bench_redistribute          (launches its own 2 ranks on 127.0.0.1)
//   scripts/bench redistribute
//
// For each 1-D transition and each size, rank-synchronised iterations alternate (A B B A ...)
// between (A) dtensor::redistribute() on a DTensor, under at::NoGradGuard, and (B) the same
// collective called directly through dtensor::comm on the plain local tensor (or, for
// R -> S(0), the same local chunk copy). A call's time is the slowest rank's; the table shows
// medians, and the overhead is the median of the back-to-back pair differences relative to the
// direct median. The last line is machine-readable:
//   RESULT redistribute_overhead_pct=<worst at 1 MiB> redistribute_overhead_pct_64mib=<worst at 64
//   MiB>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/dtensor.h"

namespace {

constexpr int kRanks = 2;

constexpr const char* kUsage = R"(usage: bench_redistribute [--quick]

Times dtensor::redistribute() against the c10d collective it stands for, called directly on a
plain tensor through dtensor::comm, for S(0)->R, P->R, P->S(0), S(0)->S(1) and R->S(0) on
float32 tensors of 1 MiB and 64 MiB (global size), on a 1-D mesh of 2 ranks over Gloo.

Started without RANK in the environment it launches its 2 ranks itself (127.0.0.1, a free
port), prints rank 0's output and exits with the ranks' status. Started by a launcher
(RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, e.g. `dtrun -n 2`) it is one rank.

The last line is:
  RESULT redistribute_overhead_pct=<worst over transitions at 1 MiB> redistribute_overhead_pct_64mib=<worst at 64 MiB>

options:
  --quick   few iterations: a smoke test, not a measurement
  --help    print this help
)";

struct Options {
  bool quick = false;
};

// ---------------------------------------------------------------------------------------------
// Launcher: runs this program as ranks 0..kRanks-1 and waits for them.

// A TCP port on 127.0.0.1 that nothing listens on right now.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

// Exit status of a waited-for child, shell style (128 + signal when killed).
int exit_status(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
  return 1;
}

// The ranks being run, for the signal handler (-1: none or already reaped).
pid_t g_ranks[kRanks] = {-1, -1};

// SIGTERM/SIGINT/SIGHUP sent to the launcher (by `timeout`, say) are passed on to the ranks,
// which would otherwise be left running.
void forward_signal(int sig) {
  for (pid_t p : g_ranks) {
    if (p > 0) ::kill(p, sig);
  }
}

int launch_ranks(char** argv) {
  const int port = free_port();
  if (port < 0) {
    std::cerr << "bench_redistribute: no free port on 127.0.0.1: " << std::strerror(errno) << "\n";
    return 1;
  }
  std::cout.flush();
  std::vector<pid_t> pids;
  for (int r = 0; r < kRanks; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::cerr << "bench_redistribute: fork failed: " << std::strerror(errno) << "\n";
      for (pid_t p : pids) ::kill(p, SIGTERM);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      return 1;
    }
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(kRanks).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(kRanks).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (r != 0) {  // only rank 0's output is shown; errors (stderr) are kept for every rank
        const int devnull = ::open("/dev/null", O_WRONLY);
        if (devnull >= 0) {
          ::dup2(devnull, STDOUT_FILENO);
          ::close(devnull);
        }
      }
      ::execv("/proc/self/exe", argv);
      std::fprintf(stderr, "bench_redistribute: rank %d: exec failed: %s\n", r,
                   std::strerror(errno));
      ::_exit(127);
    }
    pids.push_back(pid);
    g_ranks[r] = pid;
  }
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  // Wait for every rank. When one fails the others would only hang in their next collective
  // until the timeout, so they are stopped.
  int status = 0;
  size_t running = pids.size();
  while (running > 0) {
    int wstatus = 0;
    const pid_t done = ::waitpid(-1, &wstatus, 0);
    if (done < 0) {
      if (errno == EINTR) continue;
      break;
    }
    auto it = std::find(pids.begin(), pids.end(), done);
    if (it == pids.end()) continue;
    const int rank = static_cast<int>(it - pids.begin());
    *it = -1;
    g_ranks[rank] = -1;
    --running;
    const int code = exit_status(wstatus);
    if (code != 0 && status == 0) {
      status = code;
      std::cerr << "bench_redistribute: rank " << rank << " exited with status " << code
                << "; stopping the other ranks\n";
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, SIGTERM);
      }
    }
  }
  return status;
}

// ---------------------------------------------------------------------------------------------
// One rank.

struct Case {
  std::string transition;   // "S(0)->R"
  std::string direct_name;  // what (B) runs
  std::function<at::Tensor()> ours;
  std::function<at::Tensor()> direct;
};

// Medians in microseconds. The overhead is the median of the per-pair differences (ours minus
// direct, measured back to back), which cancels the slow phases a busy 2-core machine goes
// through far better than the difference of the two medians does.
struct Timing {
  double ours_us, direct_us, diff_us;
};

struct Result {
  std::string transition, direct_name, size;
  Timing t;
  double overhead_pct() const { return t.diff_us / t.direct_us * 100.0; }
};

class Bench {
 public:
  Bench() : world_(dtensor::comm::world_group()) {}

  // All ranks leave together: a Gloo all-reduce of one element (tighter than the store barrier).
  void sync() { dtensor::comm::all_reduce(one_, dtensor::ReduceOp::Sum, *world_); }

  // True on every rank when `ok` is true on every rank.
  bool all_agree(bool ok) {
    at::Tensor vote = at::tensor({ok ? 1 : 0}, at::kInt);
    return dtensor::comm::all_reduce(vote, dtensor::ReduceOp::Min, *world_).item<int>() == 1;
  }

  // Per-iteration times of this rank -> the slowest rank's time, per iteration.
  std::vector<double> slowest(const std::vector<double>& mine) {
    at::Tensor t = at::tensor(mine, at::kDouble).unsqueeze(0);
    at::Tensor all = dtensor::comm::all_gather_into_tensor(t, 0, *world_);  // [ranks, iters]
    at::Tensor worst = std::get<0>(all.max(0)).contiguous();
    return std::vector<double>(worst.data_ptr<double>(), worst.data_ptr<double>() + worst.numel());
  }

  // `iters` interleaved pairs after `warmup` of each.
  Timing time(const Case& c, int warmup, int iters) {
    for (int i = 0; i < warmup; ++i) {
      sync();
      c.ours();
      sync();
      c.direct();
    }
    std::vector<double> a, b;
    a.reserve(iters);
    b.reserve(iters);
    auto timed = [this](const std::function<at::Tensor()>& f) {
      sync();
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor out = f();
      const auto t1 = std::chrono::steady_clock::now();
      return std::chrono::duration<double, std::micro>(t1 - t0).count();
    };
    // A B B A A B ...: each side runs first in half of the pairs, so whatever the first call
    // of a pair pays (or leaves behind for the second) is shared equally.
    for (int i = 0; i < iters; ++i) {
      if (i % 2 == 0) {
        a.push_back(timed(c.ours));
        b.push_back(timed(c.direct));
      } else {
        b.push_back(timed(c.direct));
        a.push_back(timed(c.ours));
      }
    }
    const std::vector<double> sa = slowest(a), sb = slowest(b);
    std::vector<double> diff(sa.size());
    for (size_t i = 0; i < sa.size(); ++i) diff[i] = sa[i] - sb[i];
    return {median(sa), median(sb), median(diff)};
  }

  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }

 private:
  std::shared_ptr<dtensor::comm::ProcessGroup> world_;
  at::Tensor one_ = at::ones({1});
};

std::string fixed(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", precision, v);
  return buf;
}

int run_rank(const Options& opt) {
  using dtensor::Partial;
  using dtensor::Replicate;
  using dtensor::Shard;
  at::set_num_threads(1);  // one core per rank
  dtensor::comm::init_process_group();
  const int rank = dtensor::comm::get_rank();
  const int world = dtensor::comm::get_world_size();
  if (world < 2) {
    std::cerr << "bench_redistribute: needs at least 2 ranks (WORLD_SIZE=" << world << ")\n";
    return 2;
  }
  auto mesh = dtensor::init_device_mesh("cpu", {world});
  auto& pg = mesh.group(0);
  at::NoGradGuard no_grad;
  Bench bench;

  struct Size {
    std::string label;
    int64_t side;  // square side x side float32 tensor
    int warmup, iters;
  };
  std::vector<Size> sizes = {{"1 MiB", 512, 20, 400}, {"64 MiB", 4096, 3, 30}};
  if (opt.quick) sizes = {{"1 MiB", 512, 2, 10}, {"64 MiB", 4096, 1, 3}};

  auto say = [rank](const std::string& line) {
    if (rank == 0) std::cout << line << std::endl;
  };
  say("bench_redistribute: " + std::to_string(world) + " ranks on one machine (Gloo over " +
      "127.0.0.1), 1 intra-op thread per rank, float32");
  say("ours   = dtensor::redistribute(dt, placements) under at::NoGradGuard; size = global tensor");
  say("direct = the same collective through dtensor::comm on the plain local tensor");
  say("ours us, direct us = medians of the slowest rank's time per call; the calls alternate "
      "A B B A ...");
  say("         and the ranks synchronise (a Gloo all-reduce) before each call");
  say("diff us = median of the per-pair differences ours - direct (pairs run back to back);");
  say("overhead % = diff us / direct us");
  std::string iters_line = "iterations:";
  for (const auto& s : sizes) {
    iters_line += " " + s.label + " " + std::to_string(s.iters) + " (+" + std::to_string(s.warmup) +
                  " warm-up)";
  }
  say(iters_line + (opt.quick ? "  [--quick: smoke test only]" : ""));
  say("");

  std::vector<Result> results;
  bool all_match = true;
  for (const auto& sz : sizes) {
    at::manual_seed(0);
    const at::Tensor full = at::randn({sz.side, sz.side});
    const int64_t chunk = sz.side / world;
    // The inputs: a Shard(0) DTensor, a Partial one and a Replicate one, with their locals.
    const at::Tensor s0 = dtensor::distribute_tensor(full, mesh, {Shard(0)});
    const at::Tensor s0_local = dtensor::local_tensor(s0);
    const at::Tensor p = dtensor::from_local(full.clone(), mesh, {Partial()});
    const at::Tensor p_local = dtensor::local_tensor(p);
    const at::Tensor r = dtensor::distribute_tensor(full, mesh, {Replicate()});
    const at::Tensor r_local = dtensor::local_tensor(r);

    const std::vector<Case> cases = {
        {"S(0)->R", "all_gather_into_tensor",
         [&] { return dtensor::redistribute(s0, {Replicate()}); },
         [&] { return dtensor::comm::all_gather_into_tensor(s0_local, 0, pg); }},
        {"P->R", "all_reduce", [&] { return dtensor::redistribute(p, {Replicate()}); },
         [&] { return dtensor::comm::all_reduce(p_local, dtensor::ReduceOp::Sum, pg); }},
        {"P->S(0)", "reduce_scatter_tensor", [&] { return dtensor::redistribute(p, {Shard(0)}); },
         [&] {
           return dtensor::comm::reduce_scatter_tensor(p_local, 0, dtensor::ReduceOp::Sum, pg);
         }},
        {"S(0)->S(1)", "all_gather + chunk copy",
         [&] { return dtensor::redistribute(s0, {Shard(1)}); },
         [&] {
           return dtensor::comm::all_gather_into_tensor(s0_local, 0, pg)
               .narrow(1, rank * chunk, chunk)
               .contiguous();
         }},
        {"R->S(0)", "chunk copy (no comm)", [&] { return dtensor::redistribute(r, {Shard(0)}); },
         [&] { return r_local.narrow(0, rank * chunk, chunk).clone(); }},
    };

    for (const auto& c : cases) {
      // Both sides must compute the same thing before their times mean anything.
      const at::Tensor a = dtensor::local_tensor(c.ours());
      const at::Tensor b = c.direct();
      const bool same = a.sizes() == b.sizes() && at::equal(a, b);
      if (!same) {
        std::cerr << "bench_redistribute: rank " << rank << ": " << c.transition << " at "
                  << sz.label << ": redistribute() gave " << a.sizes()
                  << " but the direct collective gave " << b.sizes()
                  << (a.sizes() == b.sizes() ? " with different values" : "") << "\n";
      }
      // The ranks vote so that all of them skip a wrong case (and its collectives) together.
      if (!bench.all_agree(same)) {
        all_match = false;
        continue;
      }
      results.push_back(
          {c.transition, c.direct_name, sz.label, bench.time(c, sz.warmup, sz.iters)});
    }
  }

  if (rank == 0) {
    std::printf("%-11s %-7s %11s %11s %10s %11s   %s\n", "transition", "size", "ours us",
                "direct us", "diff us", "overhead %", "direct call");
    std::printf("%s\n",
                std::string(11 + 1 + 7 + 1 + 11 + 1 + 11 + 1 + 10 + 1 + 11 + 3 + 23, '-').c_str());
    for (const auto& r : results) {
      std::printf("%-11s %-7s %11s %11s %+10.1f %+11.1f   %s\n", r.transition.c_str(),
                  r.size.c_str(), fixed(r.t.ours_us, 1).c_str(), fixed(r.t.direct_us, 1).c_str(),
                  r.t.diff_us, r.overhead_pct(), r.direct_name.c_str());
    }
    std::printf("\n");
  }
  if (!all_match) {
    std::cerr << "bench_redistribute: rank " << rank
              << ": redistribute() and the direct collective disagree; no RESULT\n";
    return 1;
  }
  double worst_small = -1e300, worst_large = -1e300;
  for (const auto& r : results) {
    double& w = r.size == sizes.front().label ? worst_small : worst_large;
    w = std::max(w, r.overhead_pct());
  }
  if (rank == 0) {
    std::printf("RESULT redistribute_overhead_pct=%.1f redistribute_overhead_pct_64mib=%.1f\n",
                worst_small, worst_large);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (arg == "--quick") {
      opt.quick = true;
      continue;
    }
    std::cerr << "bench_redistribute: unknown option '" << arg << "'\n\n" << kUsage;
    return 2;
  }
  if (std::getenv("RANK") == nullptr) return launch_ranks(argv);
  try {
    return run_rank(opt);
  } catch (const c10::Error& e) {
    std::cerr << "bench_redistribute: " << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "bench_redistribute: " << e.what() << std::endl;
  }
  return 1;
}
