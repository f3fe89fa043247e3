#include "published_models.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include "dtensor/models/hf_checkpoint.h"

namespace dtensor::plan {
namespace {

using nlohmann::json;

// The keys of each published config.json that shape the model (the Hub's files for
// Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, mistralai/Mixtral-8x7B-v0.1, openai/gpt-oss-120b;
// gpt-oss's MXFP4 quantization_config is left out: a plan trains the dequantised experts).
json qwen3_moe(int64_t hidden, int64_t layers, int64_t heads, int64_t moe_intermediate,
               int64_t dense_intermediate) {
  return {{"architectures", {"Qwen3MoeForCausalLM"}},
          {"hidden_size", hidden},
          {"num_hidden_layers", layers},
          {"num_attention_heads", heads},
          {"num_key_value_heads", 4},
          {"head_dim", 128},
          {"intermediate_size", dense_intermediate},
          {"moe_intermediate_size", moe_intermediate},
          {"num_experts", 128},
          {"num_experts_per_tok", 8},
          {"norm_topk_prob", true},
          {"decoder_sparse_step", 1},
          {"mlp_only_layers", json::array()},
          {"router_aux_loss_coef", 0.001},
          {"vocab_size", 151936},
          {"max_position_embeddings", 40960},
          {"rope_theta", 1000000.0},
          {"rms_norm_eps", 1e-6},
          {"attention_bias", false},
          {"use_sliding_window", false},
          {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"}};
}

json mixtral_8x7b() {
  return {{"architectures", {"MixtralForCausalLM"}},
          {"hidden_size", 4096},
          {"num_hidden_layers", 32},
          {"num_attention_heads", 32},
          {"num_key_value_heads", 8},
          {"intermediate_size", 14336},
          {"num_local_experts", 8},
          {"num_experts_per_tok", 2},
          {"router_aux_loss_coef", 0.02},
          {"vocab_size", 32000},
          {"max_position_embeddings", 32768},
          {"rope_theta", 1000000.0},
          {"rms_norm_eps", 1e-5},
          {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"}};
}

json gpt_oss_120b() {
  json layer_types = json::array();
  for (int i = 0; i < 36; ++i)
    layer_types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  return {{"architectures", {"GptOssForCausalLM"}},
          {"hidden_size", 2880},
          {"num_hidden_layers", 36},
          {"num_attention_heads", 64},
          {"num_key_value_heads", 8},
          {"head_dim", 64},
          {"intermediate_size", 2880},
          {"num_local_experts", 128},
          {"num_experts_per_tok", 4},
          {"router_aux_loss_coef", 0.9},
          {"swiglu_limit", 7.0},
          {"attention_bias", true},
          {"sliding_window", 128},
          {"layer_types", layer_types},
          {"vocab_size", 201088},
          {"max_position_embeddings", 131072},
          {"rope_theta", 150000.0},
          {"rope_scaling",
           {{"rope_type", "yarn"},
            {"factor", 32.0},
            {"beta_fast", 32.0},
            {"beta_slow", 1.0},
            {"truncate", false},
            {"original_max_position_embeddings", 4096}}},
          {"rms_norm_eps", 1e-5},
          {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"}};
}

}  // namespace

const std::vector<std::string>& published_moe_models() {
  static const std::vector<std::string> names = {"qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b",
                                                 "gpt-oss-120b"};
  return names;
}

models::DecoderConfig published_moe_model(const std::string& name) {
  json j;
  if (name == "qwen3-30b-a3b")
    j = qwen3_moe(2048, 48, 32, 768, 6144);
  else if (name == "qwen3-235b-a22b")
    j = qwen3_moe(4096, 94, 64, 1536, 12288);
  else if (name == "mixtral-8x7b")
    j = mixtral_8x7b();
  else if (name == "gpt-oss-120b")
    j = gpt_oss_120b();
  else
    TORCH_CHECK(false, "dtensor_plan: no published model named '", name, "'");
  return models::hf_config_from_json(j.dump(), "dtensor_plan --model " + name).config;
}

}  // namespace dtensor::plan
