// bench_moe: (1) the experts of a mixture-of-experts block computed as one grouped product per
// projection (at::_grouped_mm) against a loop of one product per expert, per dtype and size,
// forward and forward + backward. Both give the same bits (the CPU kernel multiplies each
// expert's rows alone: tests/models/test_moe.cpp); this decides which is faster where both run
// (models::expert_compute_for). (2) Under tensor parallelism on 2 ranks over Gloo: the experts
// split like a dense feed-forward (each rank its columns of every expert's gate/up and rows of
// its down projection, the outputs summed by one all-reduce, the input's and the router's
// gradients by one each) against the experts replicated (every rank computes all of them, no
// communication), forward + backward.
//
//   build/bench/bench_moe [--threads N] [--iters N]
//   scripts/bench moe
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/cli.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/comm/process_group.h"
#include "dtensor/models/moe.h"

namespace {

constexpr const char* kUsage =
    R"(usage: bench_moe [--threads N] [--iters N]

Times a mixture-of-experts block's experts (route + experts_forward, SwiGLU, top-k routing of
random tokens) computed by the grouped product and by the loop over experts, for float32 and
bfloat16 at several sizes (tokens T, hidden H, expert width I, experts E, top k), forward alone and
forward + backward; then, on 2 ranks over Gloo (float32, forward + backward), the experts split
over the ranks like a dense feed-forward against the experts replicated on both. Prints two
tables (median milliseconds) and a last line:
  RESULT grouped_speedup_f32=<geometric mean of loop/grouped> grouped_speedup_bf16=<...> faster_f32=<grouped|loop> faster_bf16=<grouped|loop> split_speedup_tp2_fixture=<replicated/split at the tests' size> split_speedup_tp2=<geometric mean of replicated/split at the larger sizes>

options:
  --threads N   intra-op threads (default 1, as each rank runs in tests)
  --iters N     timed repetitions per case (default 5; the median is reported)
  --help        print this help
)";

using dtensor::models::ExpertCompute;
using dtensor::models::MoeOptions;

struct Size {
  const char* name;
  int64_t T, H, I, E, k;
};

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

const std::vector<Size>& sizes() {
  static const std::vector<Size> s{
      {"fixture", 24, 32, 16, 8, 2},      // the tests' checkpoints
      {"decode", 4, 1024, 384, 64, 8},    // a decode step of 4 rows, fine-grained experts
      {"prefill", 256, 512, 256, 32, 4},  // fine-grained experts (Qwen3-MoE-like, narrower)
      {"coarse", 256, 512, 1024, 8, 2},   // few wide experts (Mixtral-like)
  };
  return s;
}

// Median time of `iters` runs of one block (after one warm-up).
double time_block(const Size& s, at::ScalarType dtype, ExpertCompute compute, bool backward,
                  int iters) {
  at::manual_seed(0);
  MoeOptions o{.num_experts = s.E, .top_k = s.k, .renormalize = true, .compute = compute};
  const at::Tensor x0 = at::randn({s.T, s.H}).to(dtype);
  const at::Tensor router = (at::randn({s.E, s.H}) * 0.5).to(dtype);
  dtensor::models::ExpertWeights w;
  w.w1 = (at::randn({s.E, s.I, s.H}) * 0.05).to(dtype);
  w.w2 = (at::randn({s.E, s.H, s.I}) * 0.05).to(dtype);
  w.w3 = (at::randn({s.E, s.I, s.H}) * 0.05).to(dtype);
  if (backward) {
    for (at::Tensor* t : {&w.w1, &w.w2, &w.w3}) t->requires_grad_(true);
  }
  std::vector<double> times;
  for (int i = 0; i <= iters; ++i) {
    const at::Tensor x = backward ? x0.clone().requires_grad_(true) : x0;
    const auto start = std::chrono::steady_clock::now();
    {
      at::AutoGradMode grad(backward);
      const auto r = dtensor::models::route(x, router, {}, o);
      const at::Tensor y = dtensor::models::experts_forward(x, r, w, o);
      if (backward) y.backward(at::ones_like(y));
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (i > 0) times.push_back(ms);
    if (backward) {
      for (at::Tensor* t : {&w.w1, &w.w2, &w.w3}) t->mutable_grad() = at::Tensor();
    }
  }
  return median_ms(times);
}

// One rank of the TP comparison: forward + backward of one block with the experts split over the
// ranks (this rank's columns of w1/w3, rows of w2; the outputs, the input's gradient and the
// router's gradient all-reduced) or replicated. Rank 0 writes "split replicated" medians (the
// slower rank's) per size to `out`.
int run_rank(int iters, const std::string& out) {
  namespace comm = dtensor::comm;
  comm::init_process_group();
  auto world = comm::world_group();
  const int64_t rank = comm::get_rank(), tp = comm::get_world_size();
  std::ofstream file;
  if (rank == 0) file.open(out);
  for (const Size& s : sizes()) {
    at::manual_seed(0);
    MoeOptions o{.num_experts = s.E, .top_k = s.k, .renormalize = true};
    const at::Tensor x0 = at::randn({s.T, s.H});
    const at::Tensor router0 = at::randn({s.E, s.H}) * 0.5;
    dtensor::models::ExpertWeights whole;
    whole.w1 = at::randn({s.E, s.I, s.H}) * 0.05;
    whole.w2 = at::randn({s.E, s.H, s.I}) * 0.05;
    whole.w3 = at::randn({s.E, s.I, s.H}) * 0.05;
    const int64_t cols = s.I / tp;
    dtensor::models::ExpertWeights mine;
    mine.w1 = whole.w1.narrow(1, rank * cols, cols).contiguous();
    mine.w2 = whole.w2.narrow(2, rank * cols, cols).contiguous();
    mine.w3 = whole.w3.narrow(1, rank * cols, cols).contiguous();
    double median[2];
    for (int split = 1; split >= 0; --split) {
      dtensor::models::ExpertWeights w = split ? mine : whole;
      for (at::Tensor* t : {&w.w1, &w.w2, &w.w3}) *t = t->clone().requires_grad_(true);
      const at::Tensor router = router0.clone().requires_grad_(true);
      std::vector<double> times;
      for (int i = 0; i <= iters; ++i) {
        comm::all_reduce(at::zeros({1}), dtensor::ReduceOp::Sum, *world);  // start together
        const auto start = std::chrono::steady_clock::now();
        const at::Tensor x = x0.clone().requires_grad_(true);
        const auto r = dtensor::models::route(x, router, {}, o);
        const at::Tensor y = dtensor::models::experts_forward(x, r, w, o);
        if (split) comm::all_reduce(y.detach(), dtensor::ReduceOp::Sum, *world);
        y.backward(at::ones_like(y));
        if (split) {
          comm::all_reduce(x.grad(), dtensor::ReduceOp::Sum, *world);
          comm::all_reduce(router.grad(), dtensor::ReduceOp::Sum, *world);
        }
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count();
        if (i > 0) times.push_back(ms);
        for (at::Tensor* t : {&w.w1, &w.w2, &w.w3}) t->mutable_grad() = at::Tensor();
        router.mutable_grad() = at::Tensor();
      }
      const at::Tensor slowest = comm::all_reduce(at::full({1}, median_ms(times), at::kDouble),
                                                  dtensor::ReduceOp::Max, *world);
      median[split] = slowest.item<double>();
    }
    if (rank == 0) file << median[1] << " " << median[0] << "\n";
  }
  comm::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, iters = 5;
  CLI::App app("", "bench_moe");
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_option("--iters", iters)->check(CLI::PositiveNumber);
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) return *code;
  at::set_num_threads(threads);
  if (std::getenv("RANK") != nullptr) {
    const char* out = std::getenv("DTENSOR_BENCH_OUT");  // rank 0's only
    return run_rank(iters, out ? out : "");
  }

  std::printf("LibTorch %d.%d.%d, %d intra-op thread(s), median of %d\n\n", TORCH_VERSION_MAJOR,
              TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, threads, iters);
  std::printf("%-8s %-9s %5s %5s %5s %4s %2s  %-9s %10s %10s %12s\n", "dtype", "size", "T", "H",
              "I", "E", "k", "pass", "loop ms", "grouped ms", "loop/grouped");
  double log_sum[2] = {0, 0};
  int count[2] = {0, 0};
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16};
  for (int d = 0; d < 2; ++d) {
    for (const Size& s : sizes()) {
      for (bool backward : {false, true}) {
        const double loop = time_block(s, dtypes[d], ExpertCompute::kLoop, backward, iters);
        const double grouped = time_block(s, dtypes[d], ExpertCompute::kGroupedMm, backward, iters);
        std::printf("%-8s %-9s %5lld %5lld %5lld %4lld %2lld  %-9s %10.3f %10.3f %12.2f\n",
                    d == 0 ? "float32" : "bfloat16", s.name, static_cast<long long>(s.T),
                    static_cast<long long>(s.H), static_cast<long long>(s.I),
                    static_cast<long long>(s.E), static_cast<long long>(s.k),
                    backward ? "fwd+bwd" : "forward", loop, grouped, loop / grouped);
        std::fflush(stdout);
        log_sum[d] += std::log(loop / grouped);
        ++count[d];
      }
    }
  }
  const double f32 = std::exp(log_sum[0] / count[0]), bf16 = std::exp(log_sum[1] / count[1]);

  char pattern[] = "/tmp/bench_moe_XXXXXX";
  const int fd = ::mkstemp(pattern);
  if (fd < 0) {
    std::cerr << "bench_moe: cannot create a temporary file\n";
    return 1;
  }
  ::close(fd);
  const int status =
      dtensor::bench::run_local_ranks("bench_moe", argc, argv, 2, {{"DTENSOR_BENCH_OUT", pattern}});
  std::ifstream in(pattern);
  ::unlink(pattern);
  if (status != 0) return status;
  std::printf("\nTP=2 over Gloo, float32, forward + backward, 1 thread per rank (slower rank)\n");
  std::printf("%-9s %5s %5s %5s %4s %2s  %13s %11s %16s\n", "size", "T", "H", "I", "E", "k",
              "replicated ms", "split ms", "replicated/split");
  double log_split = 0, fixture = 0;
  for (const Size& s : sizes()) {
    double split = 0, replicated = 0;
    in >> split >> replicated;
    if (std::string(s.name) == "fixture") {
      fixture = replicated / split;
    } else {
      log_split += std::log(replicated / split);
    }
    std::printf("%-9s %5lld %5lld %5lld %4lld %2lld  %13.3f %11.3f %16.2f\n", s.name,
                static_cast<long long>(s.T), static_cast<long long>(s.H),
                static_cast<long long>(s.I), static_cast<long long>(s.E),
                static_cast<long long>(s.k), replicated, split, replicated / split);
  }
  std::printf(
      "\nRESULT grouped_speedup_f32=%.3f grouped_speedup_bf16=%.3f faster_f32=%s "
      "faster_bf16=%s split_speedup_tp2_fixture=%.3f split_speedup_tp2=%.3f\n",
      f32, bf16, f32 >= 1 ? "grouped" : "loop", bf16 >= 1 ? "grouped" : "loop", fixture,
      std::exp(log_split / static_cast<double>(sizes().size() - 1)));
  return 0;
}
