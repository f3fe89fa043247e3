// bench_expert_parallel: one mixture-of-experts block's training step (route, experts, auxiliary
// loss, backward, the router's gradient summed) on one rank holding every expert (EP 1, the whole
// batch) against 2 ranks each holding half of the experts and half of the batch (EP 2, tokens
// sent to their experts' rank by all-to-all), dropless and with capacity dispatch, in float32 at a
// size where the experts' products dominate. Each rank runs one intra-op thread.
//
//   build/bench/bench_expert_parallel [--iters N] [--backend gloo|mpi]
//   scripts/bench expert_parallel
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/cli.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/comm/process_group.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/expert_parallel.h"
#include "dtensor/models/moe.h"
#include "dtensor/tp/partial_grads.h"

namespace {

constexpr const char* kUsage =
    R"(usage: bench_expert_parallel [--iters N]

Times one mixture-of-experts block's training step (T = 1024 tokens of hidden size 512, 8
experts of width 1024, top 2, SwiGLU, float32, forward + auxiliary loss + backward) on one rank
holding every expert (EP 1) and on 2 ranks each holding 4 experts and 512 of the tokens (EP 2),
dropless and with capacity dispatch (factor 1.25), one intra-op thread per rank, collectives on
the library's default engine. Prints a table (median milliseconds, the slower rank) and a last
line:
  RESULT ep2_speedup_dropless=<EP1 / EP2 dropless> ep2_speedup_capacity=<EP1 / EP2 capacity> capacity_vs_dropless=<dropless / capacity at EP 2>

options:
  --iters N     timed repetitions per case (default 5; the median is reported)
  --help        print this help
)";

constexpr int64_t kTokens = 1024, kHidden = 512, kWidth = 1024, kExperts = 8, kTopK = 2;

// One rank: `cases` medians (ms, the slower rank's) written by rank 0 to `out`, one per line.
int run_rank(int iters, const std::string& out) {
  namespace comm = dtensor::comm;
  namespace models = dtensor::models;
  comm::init_process_group();
  const int64_t world = comm::get_world_size(), rank = comm::get_rank();
  auto group = comm::world_group();
  std::ofstream file;
  if (rank == 0) file.open(out);
  std::vector<std::optional<models::ExpertParallelOptions>> cases;
  if (world == 1) {
    cases.push_back(std::nullopt);
  } else {
    cases.push_back(models::ExpertParallelOptions{.dispatch = models::MoeDispatch::kDropless});
    cases.push_back(models::ExpertParallelOptions{.dispatch = models::MoeDispatch::kCapacity,
                                                  .capacity_factor = 1.25});
  }
  for (const auto& ep : cases) {
    at::manual_seed(0);
    const models::MoeOptions o{.num_experts = kExperts, .top_k = kTopK, .renormalize = true};
    models::MoE moe(kHidden, kWidth, o);
    if (ep) {
      auto mesh = dtensor::init_device_mesh("cpu", {world}, {"ep"});
      models::apply_expert_parallel(*moe, mesh, *ep);
    }
    // This rank's share of the batch.
    const at::Tensor x0 = at::randn({kTokens, kHidden}).chunk(world)[rank];
    std::vector<double> times;
    for (int i = 0; i <= iters; ++i) {
      comm::all_reduce(at::zeros({1}), dtensor::ReduceOp::Sum, *group);  // start together
      const auto start = std::chrono::steady_clock::now();
      const at::Tensor x = x0.clone().requires_grad_(true);
      const at::Tensor y = moe->forward(x);
      const at::Tensor aux =
          models::load_balancing_loss({moe->last_router_logits()}, kExperts, kTopK);
      (y.square().mean() + 0.01 * aux).backward();
      dtensor::tp::reduce_partial_grads(*moe);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      if (i > 0) times.push_back(ms);
      for (auto& p : moe->parameters()) p.mutable_grad() = at::Tensor();
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    const at::Tensor slowest =
        comm::all_reduce(at::full({1}, median, at::kDouble), dtensor::ReduceOp::Max, *group);
    if (rank == 0) file << slowest.item<double>() << "\n";
  }
  comm::destroy_process_group();
  return 0;
}

// Runs `world` ranks of this program and returns rank 0's medians.
std::vector<double> run_ranks(int argc, char** argv, int world) {
  char pattern[] = "/tmp/bench_expert_parallel_XXXXXX";
  const int fd = ::mkstemp(pattern);
  if (fd < 0) throw std::runtime_error("cannot create a temporary file");
  ::close(fd);
  const int status = dtensor::bench::run_local_ranks("bench_expert_parallel", argc, argv, world,
                                                     {{"DTENSOR_BENCH_OUT", pattern}});
  std::ifstream in(pattern);
  std::vector<double> out;
  for (double v; in >> v;) out.push_back(v);
  ::unlink(pattern);
  if (status != 0) throw std::runtime_error("the ranks failed");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 5;
  CLI::App app("", "bench_expert_parallel");
  app.add_option("--iters", iters)->check(CLI::PositiveNumber);
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) return *code;
  at::set_num_threads(1);
  if (std::getenv("RANK") != nullptr) {
    const char* out = std::getenv("DTENSOR_BENCH_OUT");  // rank 0's only
    return run_rank(iters, out ? out : "");
  }
  std::vector<double> one, two;
  try {
    one = run_ranks(argc, argv, 1);
    two = run_ranks(argc, argv, 2);
  } catch (const std::exception& e) {
    std::cerr << "bench_expert_parallel: " << e.what() << "\n";
    return 1;
  }
  if (one.size() != 1 || two.size() != 2) {
    std::cerr << "bench_expert_parallel: the ranks wrote no timings\n";
    return 1;
  }
  std::printf("LibTorch %d.%d.%d, 1 intra-op thread per rank, median of %d, float32\n",
              TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, iters);
  std::printf("MoE block: T=%lld H=%lld I=%lld E=%lld k=%lld, forward + aux loss + backward\n\n",
              static_cast<long long>(kTokens), static_cast<long long>(kHidden),
              static_cast<long long>(kWidth), static_cast<long long>(kExperts),
              static_cast<long long>(kTopK));
  std::printf("%-28s %6s %12s %10s\n", "layout", "ranks", "step ms", "EP1/this");
  std::printf("%-28s %6d %12.2f %10.2f\n", "EP 1 (every expert)", 1, one[0], 1.0);
  std::printf("%-28s %6d %12.2f %10.2f\n", "EP 2 dropless", 2, two[0], one[0] / two[0]);
  std::printf("%-28s %6d %12.2f %10.2f\n", "EP 2 capacity (factor 1.25)", 2, two[1],
              one[0] / two[1]);
  std::printf(
      "\nRESULT ep2_speedup_dropless=%.3f ep2_speedup_capacity=%.3f capacity_vs_dropless=%.3f\n",
      one[0] / two[0], one[0] / two[1], two[0] / two[1]);
  return 0;
}
