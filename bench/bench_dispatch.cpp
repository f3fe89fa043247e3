// Per-op dispatch overhead: tiny ops on a DTensor (sharding-cache hit) vs the same op on a plain
// tensor, next to PyTorch's Python DTensor measured in the same run
// (bench/pytorch_dtensor_dispatch.py). One process, a 1-rank mesh: no communication.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/cli.h"
#include "dtensor/dtensor.h"

using namespace dtensor;

namespace {

constexpr const char* kUsage =
    R"(usage: bench_dispatch [--iters N] [--device cpu|cuda] [--python PY]
                      [--pytorch-script PATH]

Times tiny add, mul, addmm, view and sum on a DTensor (1-rank mesh, sharding-cache hit) against
the same op on a plain tensor, and runs PATH (default bench/pytorch_dtensor_dispatch.py) to time
PyTorch's Python DTensor the same way. The last line is:
  RESULT dispatch_overhead_us=<ours> pytorch_overhead_us=<theirs> ratio=<theirs/ours>

options:
  --iters N              calls per op and variant (default 20000)
  --device D             cpu (default) or cuda: the tensors on the GPU (a 1-rank CUDA mesh),
                         each block of calls ending when the GPU has run them
  --python PY            the Python that runs the PyTorch side (default python3)
  --pytorch-script PATH  the PyTorch side (default bench/pytorch_dtensor_dispatch.py)
  --help                 print this help
)";

template <typename F>
double per_call_us(F&& f, int iters, bool cuda) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  if (cuda) torch::cuda::synchronize();  // kernels run asynchronously: count until they ran
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
         iters;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// {op: [plain_us, dtensor_us]} from the Python script, or empty if it cannot run.
std::map<std::string, std::pair<double, double>> run_pytorch(const std::string& python,
                                                             const std::string& script, int iters,
                                                             const std::string& device) {
  std::map<std::string, std::pair<double, double>> out;
  const auto r =
      dtensor::bench::run_command(python + " " + dtensor::bench::find_script(script) + " --iters " +
                                  std::to_string(iters) + " --device " + device + " 2>/dev/null");
  if (!r) return out;
  const std::string& all = r->out;
  // Parse {"add": [1.0, 2.0], ...} without a JSON dependency.
  size_t pos = 0;
  while ((pos = all.find('"', pos)) != std::string::npos) {
    const size_t end = all.find('"', pos + 1);
    if (end == std::string::npos) break;
    const std::string name = all.substr(pos + 1, end - pos - 1);
    const size_t lb = all.find('[', end);
    if (lb == std::string::npos) break;
    double a = 0, b = 0;
    if (std::sscanf(all.c_str() + lb, "[%lf, %lf]", &a, &b) == 2) out[name] = {a, b};
    pos = all.find(']', lb);
    if (pos == std::string::npos) break;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20000;
  std::string script = "bench/pytorch_dtensor_dispatch.py";
  std::string device = "cpu", python = "python3";
  CLI::App app("", "bench_dispatch");
  app.add_option("--iters", iters)->check(dtensor::cli::integer(1, 1 << 30));
  app.add_option("--pytorch-script", script)->check(dtensor::cli::non_empty());
  app.add_option("--device", device)->check(dtensor::cli::one_of({"cpu", "cuda"}));
  app.add_option("--python", python)->check(dtensor::cli::non_empty());
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) return *code;
  at::set_num_threads(1);
  ::setenv("RANK", "0", 0);
  ::setenv("WORLD_SIZE", "1", 0);
  ::setenv("MASTER_ADDR", "127.0.0.1", 0);
  ::setenv("MASTER_PORT", "29731", 0);
  const bool cuda = device == "cuda";
  if (cuda &&
      (!at::detail::getCUDAHooks().hasCUDA() || at::detail::getCUDAHooks().deviceCount() == 0)) {
    std::printf(
        "bench_dispatch: no CUDA device visible (CPU-only LibTorch or no GPU): nothing timed\n");
    std::printf("RESULT dispatch_overhead_us=nan pytorch_overhead_us=nan ratio=nan\n");
    return 0;
  }
  auto mesh = init_device_mesh(device, {1});
  at::manual_seed(0);
  const auto on = at::TensorOptions().device(cuda ? at::kCUDA : at::kCPU);
  auto a = at::randn({8, 8}, on), b = at::randn({8, 8}, on), bias = at::randn({8}, on);
  // Placements that need no redistribution, so only dispatch is measured: a row-sharded
  // activation, a replicated weight and bias (a colwise-style matmul).
  auto da = distribute_tensor(a, mesh, {Shard(0)}), db = distribute_tensor(b, mesh, {Replicate()});
  auto da2 = distribute_tensor(b, mesh, {Shard(0)});
  auto dbias = distribute_tensor(bias, mesh, {Replicate()});
  struct Op {
    const char* name;
    std::function<at::Tensor()> plain, dt;
  };
  std::vector<Op> ops = {
      {"add", [&] { return a + b; }, [&] { return da + da2; }},
      {"mul", [&] { return a * 2.0; }, [&] { return da * 2.0; }},
      {"addmm", [&] { return at::addmm(bias, a, b); }, [&] { return at::addmm(dbias, da, db); }},
      {"view", [&] { return a.view({64}); }, [&] { return da.view({64}); }},
      {"sum", [&] { return a.sum(); }, [&] { return da.sum(); }},
  };
  at::NoGradGuard no_grad;
  std::map<std::string, std::pair<double, double>> ours;
  for (auto& op : ops) {
    try {
      for (int i = 0; i < 100; ++i) op.plain(), op.dt();  // warm up, fill the cache
    } catch (const std::exception& e) {
      std::printf("%-6s skipped: %s\n", op.name, e.what());
      continue;
    }
    std::vector<double> ps, ds;
    for (int r = 0; r < 7; ++r) {  // interleaved blocks: noise hits both sides
      ps.push_back(per_call_us(op.plain, iters, cuda));
      ds.push_back(per_call_us(op.dt, iters, cuda));
    }
    ours[op.name] = {median(ps), median(ds)};
  }
  auto theirs = run_pytorch(python, script, 2000, device);

  std::printf(
      "\nPer-op time of tiny (8x8) ops on %s tensors, µs per call (median of 7 "
      "interleaved blocks)\n",
      device.c_str());
  std::printf("%-6s | %10s %10s %10s | %10s %10s %10s | %8s\n", "op", "plain", "dtensor",
              "overhead", "torch", "py-DT", "overhead", "ratio");
  std::printf(
      "-------+----------------------------------+----------------------------------+---------\n");
  double sum_ours = 0, sum_theirs = 0;
  int n_ours = 0, n_theirs = 0;
  for (const auto& [name, v] : ours) {
    const double oh = v.second - v.first;
    sum_ours += oh;
    ++n_ours;
    auto it = theirs.find(name);
    if (it != theirs.end()) {
      const double toh = it->second.second - it->second.first;
      sum_theirs += toh;
      ++n_theirs;
      std::printf("%-6s | %10.2f %10.2f %10.2f | %10.2f %10.2f %10.2f | %7.1fx\n", name.c_str(),
                  v.first, v.second, oh, it->second.first, it->second.second, toh, toh / oh);
    } else {
      std::printf("%-6s | %10.2f %10.2f %10.2f | %10s %10s %10s |\n", name.c_str(), v.first,
                  v.second, oh, "-", "-", "-");
    }
  }
  const double mean_ours = n_ours ? sum_ours / n_ours : 0.0;
  std::printf("\nmean overhead: ours %.2f µs", mean_ours);
  if (n_theirs) {
    const double mean_theirs = sum_theirs / n_theirs;
    std::printf(", PyTorch DTensor %.2f µs\n", mean_theirs);
    std::printf("RESULT dispatch_overhead_us=%.3f pytorch_overhead_us=%.3f ratio=%.1f\n", mean_ours,
                mean_theirs, mean_theirs / mean_ours);
  } else {
    std::printf(" (PyTorch DTensor could not be run: is python3 with torch installed?)\n");
    std::printf("RESULT dispatch_overhead_us=%.3f pytorch_overhead_us=nan ratio=nan\n", mean_ours);
  }
  return 0;
}
