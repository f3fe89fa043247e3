// bench_moe: the experts of a mixture-of-experts block computed as one grouped product per
// projection (at::_grouped_mm) against a loop of one product per expert, per dtype and size,
// forward and forward + backward, side by side in one run. Both give the same bits (the CPU
// kernel multiplies each expert's rows alone: tests/models/test_moe.cpp); this decides which is
// faster where both run (models::expert_compute_for).
//
//   build/bench/bench_moe [--threads N] [--iters N]
//   scripts/bench moe
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "dtensor/models/moe.h"

namespace {

constexpr const char* kUsage =
    R"(usage: bench_moe [--threads N] [--iters N]

Times a mixture-of-experts block's experts (route + experts_forward, SwiGLU, top-k routing of
random tokens) computed by the grouped product and by the loop over experts, for float32 and
bfloat16 at several sizes (tokens T, hidden H, expert width I, experts E, top k), forward alone and
forward + backward. Prints a table (median milliseconds, loop / grouped) and a last line:
  RESULT grouped_speedup_f32=<geometric mean of loop/grouped> grouped_speedup_bf16=<...> faster_f32=<grouped|loop> faster_bf16=<grouped|loop>

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

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, iters = 5;
  CLI::App app("", "bench_moe");
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_option("--iters", iters)->check(CLI::PositiveNumber);
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) return *code;
  at::set_num_threads(threads);

  const std::vector<Size> sizes{
      {"fixture", 24, 32, 16, 8, 2},      // the tests' checkpoints
      {"decode", 4, 1024, 384, 64, 8},    // a decode step of 4 rows, fine-grained experts
      {"prefill", 256, 512, 256, 32, 4},  // fine-grained experts (Qwen3-MoE-like, narrower)
      {"coarse", 256, 512, 1024, 8, 2},   // few wide experts (Mixtral-like)
  };
  std::printf("LibTorch %d.%d.%d, %d intra-op thread(s), median of %d\n\n", TORCH_VERSION_MAJOR,
              TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, threads, iters);
  std::printf("%-8s %-9s %5s %5s %5s %4s %2s  %-9s %10s %10s %12s\n", "dtype", "size", "T", "H",
              "I", "E", "k", "pass", "loop ms", "grouped ms", "loop/grouped");
  double log_sum[2] = {0, 0};
  int count[2] = {0, 0};
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16};
  for (int d = 0; d < 2; ++d) {
    for (const Size& s : sizes) {
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
  std::printf(
      "\nRESULT grouped_speedup_f32=%.3f grouped_speedup_bf16=%.3f faster_f32=%s "
      "faster_bf16=%s\n",
      f32, bf16, f32 >= 1 ? "grouped" : "loop", bf16 >= 1 ? "grouped" : "loop");
  return 0;
}
