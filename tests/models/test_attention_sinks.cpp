// Attention with per-head sinks against transformers' gpt-oss eager attention
// (tests/fixtures/hf/moe_models/gpt_oss, "sinks." keys: 4 query heads over 2 KV heads, a sliding
// window of 3), and the limit where the sinks vanish (plain softmax attention).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/models/attention_sinks.h"

using namespace dtensor;
using namespace dtensor::models;
namespace safetensors = dtensor::checkpoint::safetensors;

namespace {

const std::string kReference =
    std::string(DTENSOR_HF_FIXTURES) + "/moe_models/gpt_oss/reference.safetensors";

TEST(AttentionSinks, EqualTransformersEagerAttention) {
  const auto ref = safetensors::load_file(kReference);
  // HF's (B, H, S, D) as our (B, S, H, D); its additive mask as which keys each query sees.
  const at::Tensor q = ref.at("sinks.q").transpose(1, 2), k = ref.at("sinks.k").transpose(1, 2),
                   v = ref.at("sinks.v").transpose(1, 2);
  const at::Tensor seen = ref.at("sinks.mask") == 0;
  const at::Tensor out =
      attend_with_sinks(q, k, v, ref.at("sinks.sinks"), seen, 1 / std::sqrt(8.0));
  const at::Tensor expected = ref.at("sinks.out").flatten(2);  // (B, S, H * D)
  EXPECT_LE((out - expected).abs().max().item<double>(), 1e-6);
  // A sink takes probability away from every row: the unsunk attention differs.
  const at::Tensor none = at::full({4}, -std::numeric_limits<double>::infinity());
  EXPECT_GT((attend_with_sinks(q, k, v, none, seen, 1 / std::sqrt(8.0)) - expected)
                .abs()
                .max()
                .item<double>(),
            1e-3);
}

TEST(AttentionSinks, WithoutSinksTheyArePlainCausalAttention) {
  at::manual_seed(0);
  const at::Tensor q = at::randn({2, 6, 4, 8}), k = at::randn({2, 6, 2, 8}),
                   v = at::randn({2, 6, 2, 8});
  const at::Tensor none = at::full({4}, -std::numeric_limits<double>::infinity());
  const at::Tensor out = attend_with_sinks(q, k, v, none, {}, 0.5);
  const at::Tensor expected = at::scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1),
      v.transpose(1, 2).repeat_interleave(2, 1), std::nullopt, 0.0, /*is_causal=*/true, 0.5);
  EXPECT_LE((out - expected.transpose(1, 2).flatten(2)).abs().max().item<double>(), 1e-6);
}

}  // namespace
