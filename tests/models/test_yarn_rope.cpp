// YaRN rotary scaling against transformers' gpt-oss rotary embedding
// (tests/fixtures/hf/moe_models/gpt_oss: factor 4 over 16 original positions, head_dim 8, theta
// 10000, truncate false).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/models/yarn_rope.h"

using namespace dtensor;
using namespace dtensor::models;
namespace safetensors = dtensor::checkpoint::safetensors;

namespace {

const std::string kReference =
    std::string(DTENSOR_HF_FIXTURES) + "/moe_models/gpt_oss/reference.safetensors";

TEST(YarnRope, FrequenciesAttentionFactorAndTablesEqualTransformers) {
  const auto ref = safetensors::load_file(kReference);
  const YarnRopeScaling s{.factor = 4,
                          .beta_fast = 32,
                          .beta_slow = 1,
                          .original_max_position_embeddings = 16,
                          .truncate = false};
  const at::Tensor inv_freq = yarn_inverse_frequencies(8, 10000, s);
  // transformers computes in float32, we in float64.
  EXPECT_LE((inv_freq - ref.at("yarn.inv_freq").to(at::kDouble)).abs().max().item<double>(), 1e-7);
  EXPECT_NEAR(yarn_attention_factor(s), ref.at("yarn.attention_factor").item<double>(), 1e-15);
  EXPECT_NEAR(yarn_attention_factor(s), 0.1 * std::log(4.0) + 1, 1e-15);
  const at::Tensor angles = at::outer(at::arange(24, at::kDouble), inv_freq);
  const double af = yarn_attention_factor(s);
  EXPECT_LE((angles.cos() * af - ref.at("yarn.cos")).abs().max().item<double>(), 1e-5);
  EXPECT_LE((angles.sin() * af - ref.at("yarn.sin")).abs().max().item<double>(), 1e-5);
  // Factor 1 keeps the plain frequencies; the attention factor is then 1.
  const YarnRopeScaling one{.factor = 1, .original_max_position_embeddings = 16};
  const at::Tensor plain = at::pow(10000.0, -at::arange(0, 8, 2, at::kDouble) / 8.0);
  EXPECT_LE((yarn_inverse_frequencies(8, 10000, one) - plain).abs().max().item<double>(), 1e-15);
  EXPECT_EQ(yarn_attention_factor(one), 1.0);
}

}  // namespace
