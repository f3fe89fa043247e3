#pragma once
// The plan of a layout: its validity checks, the simulated representative ranks, the collective
// ledger per (op, mesh dim, phase), memory per rank and an estimated step time from an
// alpha-beta communication model and a compute roofline (docs/PLANNING.md states the model).
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/options.h"
#include "simulate.h"

namespace dtensor::plan {

// Hardware constants of the estimate; every one is a dtensor_plan option. Defaults: H100 SXM
// GPUs, 8 to a node on NVLink 4, nodes on 400 Gb/s InfiniBand NDR (one NIC per GPU).
struct Hardware {
  double bf16_tflops = 989;  // dense bfloat16 peak (--mixed-precision bf16)
  double fp32_tflops = 494;  // dense TF32 peak (float32 runs)
  double mfu_low = 0.30;     // the achieved share of peak: the estimate's range
  double mfu_high = 0.50;
  double intra_gbps = 450;  // NVLink bus bandwidth per GPU, GB/s
  double inter_gbps = 50;   // InfiniBand per GPU, GB/s
  double intra_latency_us = 3;
  double inter_latency_us = 10;
  int64_t gpus_per_node = 8;
  double device_memory_gib = 80;
};

// One row of the ledger: collectives of one kind per step on one rank.
struct LedgerRow {
  std::string op;     // "all_gather_into_tensor", "send", ...
  std::string dim;    // mesh dim name ("tp", "dp", "pp"), or "-" for a group of one rank
  std::string phase;  // forward | backward | optimizer
  int64_t count = 0;
  int64_t bytes = 0;   // sum of the recorded bytes (this rank's inputs)
  double seconds = 0;  // by the alpha-beta model
};

struct RankPlan {
  RankResult sim;
  std::vector<LedgerRow> ledger;
  int64_t total_count = 0, total_bytes = 0;
  double comm_exposed_s = 0;       // TP, plain dp all_reduce, optimizer: the compute waits
  double comm_overlappable_s = 0;  // FSDP gathers/reduce-scatters and pipeline messages
  double flops = 0;  // this rank's per step (forward, backward, recompute), from its ops
  double step_low_s = 0, step_high_s = 0;
  int64_t peak_bytes = 0;  // steady state, by the meta allocator
};

struct Plan {
  train::RunConfig config;
  std::vector<std::string> refusals;  // each with its fix; empty: valid
  std::vector<std::string> warnings;
  std::vector<RankPlan> ranks;
  std::vector<std::string> not_simulated;
  double step_low_s = 0, step_high_s = 0;  // the slowest rank's
  int64_t peak_bytes = 0;                  // the largest rank's
  double sim_seconds = 0;                  // wall time of the simulation
};

// What a layout is: the options dtensor_train takes, and the world size.
struct Layout {
  train::TrainOptions options;
  int64_t world_size = 1;
  std::optional<int64_t> tp;  // --tp: checked against world / (dp x pp)
};

// Checks the layout (resolve_run_config's refusals, the world's factorization), then simulates
// each representative rank and estimates. `progress(done, total, label)` is told as ranks finish.
Plan make_plan(const Layout& layout, const Hardware& hw,
               const std::function<void(int64_t, int64_t, const std::string&)>& progress = {});

// Alpha-beta time of one recorded collective on a group of `n` ranks, intra-node or not.
double collective_seconds(const std::string& op, int64_t bytes, int64_t n, bool intra,
                          const Hardware& hw);

// Every (dp, tp, pp) with dp x tp x pp = world (dp as --dp-shard when > 1), in a fixed order.
std::vector<std::tuple<int64_t, int64_t, int64_t>> splits_of(int64_t world_size);

}  // namespace dtensor::plan
