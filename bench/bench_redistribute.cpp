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
#include <fcntl.h>
#include <signal.h>
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
#include <system_error>
#include <vector>

#include "bench_support.h"
#include "common/cli.h"
#include "common/local_ranks.h"
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

// With the same arguments; returns the exit code of the first rank that fails, or 0.
int launch_ranks(int argc, char** argv) {
  return dtensor::bench::run_local_ranks("bench_redistribute", argc, argv, kRanks);
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

struct Size {
  std::string label;
  int64_t side;  // square side x side float32 tensor
  int warmup, iters;
};

void print_intro(int world, const std::vector<Size>& sizes, bool quick) {
  auto say = [](const std::string& line) { std::cout << line << std::endl; };
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
  say(iters_line + (quick ? "  [--quick: smoke test only]" : ""));
  say("");
}

// Rank 0 prints the table and the RESULT line. Returns the exit code.
int report(int rank, const std::vector<Result>& results, const std::string& small_label,
           bool all_match) {
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
    double& w = r.size == small_label ? worst_small : worst_large;
    w = std::max(w, r.overhead_pct());
  }
  if (rank == 0) {
    std::printf("RESULT redistribute_overhead_pct=%.1f redistribute_overhead_pct_64mib=%.1f\n",
                worst_small, worst_large);
    std::fflush(stdout);
  }
  return 0;
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

  std::vector<Size> sizes = {{"1 MiB", 512, 20, 400}, {"64 MiB", 4096, 3, 30}};
  if (opt.quick) sizes = {{"1 MiB", 512, 2, 10}, {"64 MiB", 4096, 1, 3}};

  if (rank == 0) print_intro(world, sizes, opt.quick);

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

  return report(rank, results, sizes.front().label, all_match);
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app("", "bench_redistribute");
  app.add_flag("--quick", opt.quick)->disable_flag_override();
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) return *code;
  if (std::getenv("RANK") == nullptr) return launch_ranks(argc, argv);
  try {
    return run_rank(opt);
  } catch (const c10::Error& e) {
    std::cerr << "bench_redistribute: " << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "bench_redistribute: " << e.what() << std::endl;
  }
  return 1;
}
