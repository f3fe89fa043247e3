// dtensor_plan's published mixture-of-experts models (apps/plan/published_models.cpp) plan on the
// meta device at a layout they fit (FSDP x TP, bfloat16 mixed precision): the model is the
// published one, each rank holds its share of the parameters, the routers' statistics are pooled
// over dp in one all-reduce per step, and the FLOPs are those of the active experts (routing
// taken as uniform on the meta device).
#include <gtest/gtest.h>

#include <string>

#include "dtensor/models/moe.h"
#include "plan/estimate.h"
#include "plan/published_models.h"

using namespace dtensor;

namespace {

struct Preset {
  std::string name;
  int64_t parameters_billions;  // the published total, rounded down
  int64_t dp_shard, tp;
};

// The parameters a token's forward multiplies by: every matrix but the embedding's, with only
// top_k of each sparse layer's experts (the router included).
double active_matmul_parameters(const models::DecoderConfig& c) {
  const models::DecoderMoe& m = *c.moe;
  int64_t sparse = 0;
  for (int64_t i = 0; i < c.n_layers; ++i)
    sparse += m.sparse_layers.empty() || m.sparse_layers[static_cast<size_t>(i)] ? 1 : 0;
  const double idle_experts = static_cast<double>(m.options.num_experts - m.options.top_k);
  const double per_expert = 3.0 * static_cast<double>(c.dim * m.expert_hidden_dim);
  return static_cast<double>(c.num_parameters()) -
         static_cast<double>(c.vocab_size * c.dim) -  // the embedding: a lookup
         static_cast<double>(sparse) * idle_experts * per_expert;
}

}  // namespace

TEST(PlanPublishedModels,
     EachMoePresetPlansWithItsShareOfParametersThePooledAuxLossAndActiveFlops) {
  const std::vector<Preset> presets = {{"qwen3-30b-a3b", 30, 8, 2},
                                       {"qwen3-235b-a22b", 235, 32, 4},
                                       {"mixtral-8x7b", 46, 8, 2},
                                       {"gpt-oss-120b", 116, 16, 4}};
  ASSERT_EQ(plan::published_moe_models().size(), presets.size());
  for (const Preset& preset : presets) {
    SCOPED_TRACE(preset.name);
    plan::Layout l;
    l.world_size = preset.dp_shard * preset.tp;
    l.tp = preset.tp;
    auto& o = l.options;
    o.model_config = plan::published_moe_model(preset.name);
    o.dp_shard = preset.dp_shard;
    o.seq_len = 256;
    o.batch_size = preset.dp_shard;  // one sequence per dp rank
    o.mixed_precision = "bf16";
    const models::DecoderConfig& c = *o.model_config;
    ASSERT_TRUE(c.moe.has_value());
    EXPECT_GE(c.num_parameters(), preset.parameters_billions * 1'000'000'000);
    EXPECT_LT(c.num_parameters(), (preset.parameters_billions + 1) * 1'000'000'000);

    const plan::Plan p = plan::make_plan(l, {});
    ASSERT_TRUE(p.refusals.empty()) << p.refusals.front();
    ASSERT_EQ(p.ranks.size(), 1u);
    const plan::RankPlan& r = p.ranks.front();
    // float32 parameters sharded over every rank, but the norms and sinks TP keeps whole.
    const double share = static_cast<double>(c.num_parameters()) * 4 / l.world_size;
    EXPECT_GE(r.sim.step.state.parameters, share);
    EXPECT_LT(r.sim.step.state.parameters, share * 1.01);
    EXPECT_LT(r.peak_bytes, int64_t{80} << 30);
    // The load-balancing loss's statistics: one all-reduce over dp of 2E + 1 float32 values.
    const int64_t experts = c.moe->options.num_experts;
    int64_t pooled = 0;
    for (const auto& row : r.ledger)
      if (row.op == "all_reduce" && row.dim == "dp") {
        EXPECT_EQ(row.phase, "forward");
        EXPECT_EQ(row.count, 1);
        EXPECT_EQ(row.bytes, (2 * experts + 1) * 4);
        ++pooled;
      }
    EXPECT_EQ(pooled, 1);
    // 6 FLOPs per active parameter and token (forward and backward), this rank's 1/tp of them,
    // plus attention's scores (a few percent at 256 tokens).
    const double tokens = static_cast<double>(*o.seq_len * *o.batch_size / o.dp_shard);
    const double expected = 6 * active_matmul_parameters(c) * tokens / preset.tp;
    EXPECT_GE(r.flops, expected);
    EXPECT_LT(r.flops, expected * 1.1);
  }
}
