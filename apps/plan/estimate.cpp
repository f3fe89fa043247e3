#include "estimate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "common/run_config.h"
#include "dtensor/pp/pipeline.h"
#include "dtensor/util/error_message.h"

namespace dtensor::plan {
namespace {

std::string short_op(CommType t) {
  std::string s = comm_type_name(t);
  s = s.substr(s.find('.') + 1);
  if (!s.empty() && s.back() == '_') s.pop_back();
  return s;
}

// Whether every rank of `ranks` sits on one node (consecutive blocks of gpus_per_node ranks).
bool one_node(const std::vector<int>& ranks, int64_t gpus_per_node) {
  for (int r : ranks)
    if (r / gpus_per_node != ranks.front() / gpus_per_node) return false;
  return true;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / (1024.0 * 1024 * 1024));
  return buf;
}

}  // namespace

double collective_seconds(const std::string& op, int64_t bytes, int64_t n, bool intra,
                          const Hardware& hw) {
  const double alpha = (intra ? hw.intra_latency_us : hw.inter_latency_us) * 1e-6;
  const double beta = 1.0 / ((intra ? hw.intra_gbps : hw.inter_gbps) * 1e9);  // s per byte
  const double b = static_cast<double>(bytes), k = static_cast<double>(n);
  if (n <= 1) return 0;
  // Ring algorithms; `bytes` is this rank's input.
  if (op == "all_gather_into_tensor") return (k - 1) * alpha + (k - 1) * b * beta;
  if (op == "reduce_scatter_tensor" || op == "all_to_all_single")
    return (k - 1) * alpha + (k - 1) / k * b * beta;
  if (op == "all_reduce") return 2 * (k - 1) * alpha + 2 * (k - 1) / k * b * beta;
  if (op == "broadcast" || op == "scatter")
    return std::ceil(std::log2(k)) * alpha + (k - 1) / k * b * beta;
  if (op == "recv") return alpha + b * beta;  // a message costs its receiver, who waits for it
  return 0;                                   // send: counted at the receiver
}

std::vector<std::tuple<int64_t, int64_t, int64_t>> splits_of(int64_t world) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
  for (int64_t pp = 1; pp <= world; ++pp) {
    if (world % pp) continue;
    for (int64_t tp = 1; tp <= world / pp; ++tp) {
      if ((world / pp) % tp) continue;
      out.emplace_back(world / (pp * tp), tp, pp);
    }
  }
  return out;
}

Plan make_plan(const Layout& layout, const Hardware& hw,
               const std::function<void(int64_t, int64_t, const std::string&)>& progress) {
  Plan plan;
  const auto t0 = std::chrono::steady_clock::now();
  const train::TrainOptions& o = layout.options;
  // The degrees' product and every rule of composing them are the trainer's
  // (resolve_run_config: models::ParallelDims); only --tp is dtensor_plan's own.
  const int64_t dp = o.dp * o.dp_shard;
  if (layout.tp && *layout.tp * dp * o.pp != layout.world_size) {
    plan.refusals.push_back("--tp " + std::to_string(*layout.tp) + " x dp " + std::to_string(dp) +
                            " x pp " + std::to_string(o.pp) + " = " +
                            std::to_string(*layout.tp * dp * o.pp) +
                            " ranks, but --world-size is " + std::to_string(layout.world_size) +
                            ": use --world-size " + std::to_string(*layout.tp * dp * o.pp) +
                            " or --tp " + std::to_string(layout.world_size / (dp * o.pp)));
    return plan;
  }
  try {
    plan.config = train::resolve_run_config(o, layout.world_size);
  } catch (const std::exception& e) {
    plan.refusals.push_back(util::error_message(e));
    return plan;
  }
  const train::RunConfig& c = plan.config;
  if (c.tp > 1 && c.model.kv_heads() % c.tp != 0)
    plan.warnings.push_back("n_kv_heads=" + std::to_string(c.model.kv_heads()) +
                            " is not divisible by tp=" + std::to_string(c.tp) +
                            ": wk and wv stay whole on every tp rank (more memory, and their "
                            "gradients are all-reduced over tp); a tp dividing " +
                            std::to_string(c.model.kv_heads()) + " shards them");
  plan.not_simulated = not_simulated(c);

  const auto who = representative_ranks(c);
  const bool bf16 = c.bf16;
  const double peak_flops = (bf16 ? hw.bf16_tflops : hw.fp32_tflops) * 1e12;
  int64_t done = 0;
  for (const RankClass& w : who) {
    RankPlan rp;
    try {
      rp.sim = simulate_rank(c, w);
    } catch (const std::exception& e) {
      plan.refusals.push_back("the library refused this layout while simulating rank " +
                              std::to_string(w.rank) + " (" + w.label +
                              "): " + util::error_message(e));
      return plan;
    }
    std::map<std::tuple<std::string, std::string, std::string>, LedgerRow> rows;
    for (const StepCollective& sc : rp.sim.step.collectives) {
      const CommRecord& r = sc.record;
      const std::string dim =
          r.mesh_dim >= 0 && r.group_size > 1 ? rp.sim.mesh_dims.at(r.mesh_dim) : "-";
      const std::string op = short_op(r.type);
      auto& row = rows[{op, dim, sc.phase}];
      row.op = op;
      row.dim = dim;
      row.phase = sc.phase;
      ++row.count;
      row.bytes += r.bytes;
      const bool intra = dim == "-" || one_node(rp.sim.group_ranks.at(dim), hw.gpus_per_node);
      const double s = collective_seconds(op, r.bytes, r.group_size, intra, hw);
      row.seconds += s;
      const bool overlappable =
          (c.fsdp && dim == "dp" && op != "all_reduce") || op == "send" || op == "recv";
      (overlappable ? rp.comm_overlappable_s : rp.comm_exposed_s) += s;
      if (dim != "-") {
        ++rp.total_count;
        rp.total_bytes += r.bytes;
      }
    }
    for (auto& [k, row] : rows) rp.ledger.push_back(row);
    rp.flops = rp.sim.step.flops;
    const double bubble = c.pp > 1 ? static_cast<double>(c.microbatches + c.pp - 1) /
                                         static_cast<double>(c.microbatches)
                                   : 1.0;
    const double compute_fast = rp.flops / (peak_flops * hw.mfu_high) * bubble;
    const double compute_slow = rp.flops / (peak_flops * hw.mfu_low) * bubble;
    rp.step_low_s =
        compute_fast + rp.comm_exposed_s + std::max(0.0, rp.comm_overlappable_s - compute_fast);
    rp.step_high_s = compute_slow + rp.comm_exposed_s + rp.comm_overlappable_s;
    rp.peak_bytes = rp.sim.step.peak_bytes();
    plan.step_low_s = std::max(plan.step_low_s, rp.step_low_s);
    plan.step_high_s = std::max(plan.step_high_s, rp.step_high_s);
    plan.peak_bytes = std::max(plan.peak_bytes, rp.peak_bytes);
    plan.ranks.push_back(std::move(rp));
    if (progress) progress(++done, static_cast<int64_t>(who.size()), w.label);
  }
  const double limit = hw.device_memory_gib * 1024 * 1024 * 1024;
  if (static_cast<double>(plan.peak_bytes) > limit) {
    std::string fix = "add activation checkpointing (--ac full)";
    if (c.ac == "full")
      fix = "shard more: a larger --dp-shard, --tp or --pp, or fewer --microbatches in flight";
    plan.refusals.push_back("peak memory " + gib(static_cast<double>(plan.peak_bytes)) +
                            " per rank is over --device-memory " + gib(limit) + ": " + fix);
  }
  plan.sim_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return plan;
}

}  // namespace dtensor::plan
