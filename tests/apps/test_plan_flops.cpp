// dtensor_plan's FLOPs per rank are counted from the ops a simulated step runs (FlopCounter):
// 2 per multiply-add of each matmul and of attention's QK^T and AV (backward twice the
// forward), as PyTorch's FlopCounterMode counts. They equal the count by hand from the model's
// shapes for TP x FSDP, TP alone, with activation checkpointing (one more forward of each
// block), and per pipeline stage, uneven and interleaved stages included; an op on DTensors
// counts its local op only, and the sharding rules' shape inference counts nothing.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "dtensor/dtensor.h"
#include "plan/estimate.h"
#include "plan/flop_counter.h"
#include "support/distributed.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

namespace {

// This rank's FLOPs per step counted by hand: each block's matmuls (2 per weight and token),
// attention's two S x S products (4 S dim per token, causal masking not subtracted), the head
// on the last stage; forward once, backward twice, and a forward again per checkpointed block;
// TP divides all of it but wk and wv when the KV heads do not split over it (then every rank
// projects them all).
double flops_by_hand(const train::RunConfig& c, int64_t pp_rank) {
  const auto& m = c.model;
  const double dim = static_cast<double>(m.dim), hd = static_cast<double>(m.head_dim());
  const double tp = static_cast<double>(c.tp);
  // wk and wv stay whole on every rank when the KV heads do not split over tp.
  const double kv_split = m.kv_heads() % c.tp == 0 ? tp : 1;
  const double weights = (dim * static_cast<double>(m.n_heads) * hd * 2 +
                          3 * dim * static_cast<double>(m.hidden_dim())) /
                             tp +
                         dim * static_cast<double>(m.kv_heads()) * hd * 2 / kv_split;
  const int64_t stages = c.pp * c.virtual_stages;
  double layers = 0;
  bool last = false;
  for (int64_t s = pp_rank; s < stages; s += c.pp) {  // this rank's stages, round-robin
    const auto [first, end] = pp::stage_layer_range(m.n_layers, s, stages);
    layers += static_cast<double>(end - first);
    last = last || s == stages - 1;
  }
  const double seq = static_cast<double>(c.seq_len);
  const double block = 2 * weights + 4 * seq * dim / tp;  // forward, per token
  const double head = last ? 2 * dim * static_cast<double>(m.vocab_size) / tp : 0;
  const double recomputed = c.ac == "full" ? layers : 0;
  const double tokens = static_cast<double>(c.batch_size) * seq / static_cast<double>(c.dp);
  return (3 * (layers * block + head) + recomputed * block) * tokens;
}

plan::Layout layout(int64_t world, int64_t dp_shard, int64_t pp, const std::string& ac = "none",
                    const std::string& schedule = "1f1b", int64_t layers = 4) {
  plan::Layout l;
  l.world_size = world;
  auto& o = l.options;
  o.preset = "tiny";
  o.layers = layers;
  o.batch_size = 8;
  o.dp_shard = dp_shard;
  o.pp = pp;
  o.ac = ac;
  if (pp > 1) {
    o.schedule = schedule;
    o.microbatches = 2;
  }
  return l;
}

}  // namespace

TEST(PlanFlops, CountsMatmulsFromTheirShapesAndNothingElse) {
  plan::FlopCounter counter;
  const auto a = at::randn({3, 4}), b = at::randn({4, 5});
  at::mm(a, b);
  EXPECT_EQ(counter.flops(), 2 * 3 * 4 * 5);
  at::addmm(at::zeros({3, 5}), a, b);
  at::bmm(at::randn({2, 3, 4}), at::randn({2, 4, 5}));
  EXPECT_EQ(counter.flops(), 2 * (2 * 3 * 4 * 5) + 2 * (2 * 3 * 4 * 5));
  at::relu(a).sum();  // not counted, as PyTorch's counter leaves them out
  EXPECT_EQ(counter.flops(), 4 * (2 * 3 * 4 * 5));
}

TEST(PlanFlops, ADTensorMatmulCountsThisRanksLocalProductOnce) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const auto x = distribute_tensor(at::randn({4, 6}), mesh, {Shard(0)});
    const auto w = distribute_tensor(at::randn({6, 8}), mesh, {Replicate()});
    dispatch::clear_cache();  // the first call compiles its decision (shape inference)
    plan::FlopCounter counter;
    at::mm(x, w);
    EXPECT_EQ(counter.flops(), 2 * 2 * 6 * 8);  // [2, 6] x [6, 8] on each rank
    at::mm(x, w);                               // the cached decision
    EXPECT_EQ(counter.flops(), 2 * (2 * 2 * 6 * 8));
  });
}

TEST(PlanFlops, ASimulatedStepCountsWhatTheModelsShapesGive) {
  struct Case {
    std::string name;
    plan::Layout l;
  };
  const std::vector<Case> cases{
      {"FSDP 2 x TP 2", layout(4, 2, 1)},
      {"TP 4 (2 KV heads: wk and wv whole on every rank)", layout(4, 1, 1)},
      {"FSDP 2 x TP 2, AC full", layout(4, 2, 1, "full")},
      {"PP 3 (2 + 1 + 1 blocks)", layout(3, 1, 3)},
      {"PP 2 x FSDP 2 x TP 2, interleaved", layout(8, 2, 2, "none", "interleaved")},
  };
  for (const auto& [name, l] : cases) {
    SCOPED_TRACE(name);
    const plan::Plan p = plan::make_plan(l, {});
    ASSERT_TRUE(p.refusals.empty()) << p.refusals.at(0);
    ASSERT_FALSE(p.ranks.empty());
    for (const auto& r : p.ranks) {
      const int64_t pp_rank = p.config.pp > 1 ? r.sim.who.coordinate.at(0) : 0;
      SCOPED_TRACE(r.sim.who.label);
      EXPECT_NEAR(r.flops, flops_by_hand(p.config, pp_rank), 1e-9 * r.flops);
      EXPECT_GT(r.flops, 0);
    }
  }
}
