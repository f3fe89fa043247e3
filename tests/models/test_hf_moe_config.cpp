// config.json's mixture-of-experts keys: the three families' fixtures read as their routing,
// experts and sparse layers; each variant that is not built, and num_experts_per_tok above the
// experts, refused naming the file, the key and its value.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtensor/models/hf_moe_config.h"
#include "support/errors.h"
#include "support/temp_dir.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

const std::string kModels = std::string(DTENSOR_HF_FIXTURES) + "/moe_models/";

nlohmann::json config_of(const std::string& name) {
  std::ifstream in(kModels + name + "/config.json");
  return nlohmann::json::parse(in);
}

// `dir`/config.json holding `j`; returns dir.
std::string write_config(const TempDir& dir, const nlohmann::json& j) {
  std::ofstream(dir.file("config.json")) << j.dump(2);
  return dir.path().string();
}

TEST(HfMoeConfig, FamiliesReadAsTheirRoutingExpertsAndSparseLayers) {
  const auto qwen = read_hf_moe_config(kModels + "qwen3_moe");
  ASSERT_TRUE(qwen.has_value());
  EXPECT_EQ(qwen->options.num_experts, 8);
  EXPECT_EQ(qwen->options.top_k, 2);
  EXPECT_TRUE(qwen->options.renormalize);
  EXPECT_FALSE(qwen->options.float32_weights);
  EXPECT_EQ(qwen->expert_hidden_dim, 16);
  EXPECT_EQ(qwen->sparse_layers, (std::vector<bool>{true, false, true}));  // mlp_only_layers [1]
  EXPECT_EQ(qwen->router_aux_loss_coef, 0.01);
  EXPECT_STREQ(qwen->layout.gate, "gate_proj");

  const auto mixtral = read_hf_moe_config(kModels + "mixtral");
  ASSERT_TRUE(mixtral.has_value());
  EXPECT_EQ(mixtral->options.num_experts, 4);
  EXPECT_TRUE(mixtral->options.renormalize && mixtral->options.float32_weights);
  EXPECT_STREQ(mixtral->layout.block, "block_sparse_moe");
  EXPECT_EQ(mixtral->sparse_layers, (std::vector<bool>{true, true}));

  for (const char* name : {"gpt_oss", "gpt_oss_mxfp4"}) {
    const auto oss = read_hf_moe_config(kModels + name);
    ASSERT_TRUE(oss.has_value());
    EXPECT_EQ(oss->options.scoring, RouterScoring::kTopKThenSoftmax);
    EXPECT_EQ(oss->options.activation, ExpertActivation::kClampedSwiGLU);
    EXPECT_EQ(oss->options.swiglu_limit, 1.0);
    EXPECT_EQ(oss->options.swiglu_alpha, 1.702);
    EXPECT_TRUE(oss->options.router_bias && oss->options.expert_bias);
    EXPECT_EQ(oss->expert_hidden_dim, 32);
    EXPECT_EQ(oss->layout.gate, nullptr);
  }

  TempDir dir;
  auto published = config_of("qwen3_moe");  // as Qwen3-30B-A3B's config.json spells it
  published.erase("num_local_experts");
  published["num_experts"] = 8;
  EXPECT_EQ(read_hf_moe_config(write_config(dir, published))->options.num_experts, 8);
  auto dense = config_of("qwen3_moe");
  dense["architectures"] = {"Qwen3ForCausalLM"};
  EXPECT_FALSE(read_hf_moe_config(write_config(dir, dense)).has_value());
}

TEST(HfMoeConfig, UnbuiltVariantsAreRefusedNamingFileKeyAndValue) {
  struct Bad {
    std::string family, key;
    nlohmann::json value;
    std::vector<std::string> parts;
  };
  const std::vector<Bad> cases{
      {"qwen3_moe",
       "num_experts_per_tok",
       9,
       {"\"num_experts_per_tok\": 9", "num_local_experts=8"}},
      {"qwen3_moe", "num_experts", 6, {"\"num_experts\": 6", "\"num_local_experts\": 8"}},
      {"mixtral", "num_experts_per_tok", 5, {"\"num_experts_per_tok\": 5", "num_local_experts=4"}},
      {"qwen3_moe", "shared_expert_intermediate_size", 64, {"shared experts"}},
      {"qwen3_moe", "n_group", 4, {"group-limited routing"}},
      {"mixtral", "kv_lora_rank", 512, {"multi-head latent attention"}},
      {"qwen3_moe",
       "layer_types",
       {"full_attention", "linear_attention", "full_attention"},
       {"linear_attention"}},
      {"qwen3_moe", "scoring_func", "sigmoid", {"\"scoring_func\": \"sigmoid\"", "router type"}},
      {"qwen3_moe", "topk_method", "noaux_tc", {"\"topk_method\": \"noaux_tc\"", "router type"}},
      {"mixtral", "router_jitter_noise", 0.1, {"\"router_jitter_noise\": 0.1"}},
      {"gpt_oss", "quantization_config", {{"quant_method", "fp8"}}, {"quant_method", "\"fp8\""}},
      {"qwen3_moe", "mlp_only_layers", {7}, {"\"mlp_only_layers\" holds 7"}},
  };
  for (const Bad& c : cases) {
    TempDir dir;
    auto j = config_of(c.family);
    j[c.key] = c.value;
    const std::string path = write_config(dir, j);
    std::vector<std::string> parts = c.parts;
    parts.push_back(dir.file("config.json"));
    const std::string msg = message_of([&] { read_hf_moe_config(path); });
    for (const auto& part : parts) EXPECT_CONTAINS(msg, part) << c.family << " " << c.key;
    if (c.key != "layer_types" && c.key != "quantization_config" && c.key != "mlp_only_layers") {
      EXPECT_CONTAINS(msg, c.key);
    }
  }
}

}  // namespace
