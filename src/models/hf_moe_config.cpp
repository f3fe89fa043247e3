// config.json's mixture-of-experts keys (dtensor/models/hf_moe_config.h).
#include "dtensor/models/hf_moe_config.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "hf_moe_config_json.h"

namespace dtensor::models {

namespace detail {

using nlohmann::json;

namespace {

// Keys of mixture-of-experts variants that are not built: refused (naming the key and its value)
// when present with a value other than null, 0, false or an empty list.
const std::vector<std::pair<const char*, const char*>>& unbuilt_moe_keys() {
  static const std::vector<std::pair<const char*, const char*>> keys{
      {"n_shared_experts", "shared experts"},
      {"num_shared_experts", "shared experts"},
      {"shared_expert_intermediate_size", "shared experts"},
      {"n_group", "group-limited routing"},
      {"topk_group", "group-limited routing"},
      {"kv_lora_rank", "multi-head latent attention (MLA)"},
      {"q_lora_rank", "multi-head latent attention (MLA)"},
      {"linear_attention_layers", "linear-attention layers"},
      {"linear_num_value_heads", "linear-attention layers"},
      {"routed_scaling_factor", "scaled routing weights"},
  };
  return keys;
}

bool moe_value_is_set(const json& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0;
  if (v.is_array() || v.is_object()) return !v.empty();
  return true;
}

}  // namespace

std::optional<HfMoeConfig> parse_hf_moe_config(const json& j, const std::string& path,
                                               const std::string& architecture, int64_t n_layers) {
  const std::string where = "Hugging Face config '" + path + "'";
  for (const auto& [key, what] : unbuilt_moe_keys()) {
    TORCH_CHECK(!j.contains(key) || !moe_value_is_set(j.at(key)), where, ": \"", key,
                "\": ", j.at(key).dump(), " asks for ", what, ", which is not built");
  }
  if (j.contains("layer_types") && j.at("layer_types").is_array()) {
    for (const auto& t : j.at("layer_types"))
      TORCH_CHECK(t != "linear_attention", where, ": \"layer_types\" holds \"linear_attention\": ",
                  "linear-attention layers are not built");
  }
  // DeepSeek-style routers: sigmoid scores, bias-corrected ("noaux_tc") or group-limited top-k.
  for (const auto& [key, built] :
       {std::pair{"scoring_func", "softmax"}, {"topk_method", "greedy"}}) {
    if (!j.contains(key) || j.at(key).is_null()) continue;
    TORCH_CHECK(j.at(key) == built, where, ": \"", key, "\": ", j.at(key).dump(),
                " is a router type that is not built; built: \"", built, "\"");
  }

  auto has = [&](const char* key) { return j.contains(key) && !j.at(key).is_null(); };
  auto get_int = [&](const char* key) -> int64_t {
    TORCH_CHECK(has(key) && j.at(key).is_number_integer(), where, ": \"", key,
                "\" must be an integer", has(key) ? ", got " + j.at(key).dump() : "");
    return j.at(key).get<int64_t>();
  };
  auto get_double = [&](const char* key, double otherwise) -> double {
    if (!has(key)) return otherwise;
    TORCH_CHECK(j.at(key).is_number(), where, ": \"", key, "\" must be a number, got ",
                j.at(key).dump());
    return j.at(key).get<double>();
  };
  auto get_bool = [&](const char* key, bool otherwise) -> bool {
    if (!has(key)) return otherwise;
    TORCH_CHECK(j.at(key).is_boolean(), where, ": \"", key, "\" must be true or false, got ",
                j.at(key).dump());
    return j.at(key).get<bool>();
  };

  HfMoeConfig c;
  // Every family's config class maps one spelling onto the other (transformers 5 writes
  // Qwen3-MoE's as num_local_experts, published Qwen3-MoE checkpoints have num_experts).
  const char* experts_key = has("num_experts") ? "num_experts" : "num_local_experts";
  if (has("num_experts") && has("num_local_experts")) {
    TORCH_CHECK(j.at("num_experts") == j.at("num_local_experts"), where,
                ": \"num_experts\": ", j.at("num_experts").dump(),
                " disagrees with \"num_local_experts\": ", j.at("num_local_experts").dump());
  }
  if (architecture == "Qwen3MoeForCausalLM") {
    c.layout = kQwen3MoeExperts;
    c.options.renormalize = get_bool("norm_topk_prob", false);
    c.expert_hidden_dim = get_int("moe_intermediate_size");
  } else if (architecture == "MixtralForCausalLM") {
    c.layout = kMixtralExperts;
    c.options.renormalize = true;
    c.options.float32_weights = true;
    c.expert_hidden_dim = get_int("intermediate_size");
    TORCH_CHECK(get_double("router_jitter_noise", 0) == 0, where,
                ": \"router_jitter_noise\": ", j.at("router_jitter_noise").dump(),
                " (multiplicative noise on the router's input in training) is not built");
  } else if (architecture == "GptOssForCausalLM") {
    c.layout = kGptOssExperts;
    c.options.scoring = RouterScoring::kTopKThenSoftmax;
    c.options.router_bias = true;
    c.options.expert_bias = true;
    c.options.activation = ExpertActivation::kClampedSwiGLU;
    c.options.swiglu_alpha = get_double("swiglu_alpha", 1.702);
    c.options.swiglu_limit = get_double("swiglu_limit", 7.0);
    c.expert_hidden_dim = get_int("intermediate_size");
    if (has("quantization_config")) {
      const json& q = j.at("quantization_config");
      const json method =
          q.is_object() && q.contains("quant_method") ? q.at("quant_method") : json(nullptr);
      TORCH_CHECK(method == "mxfp4", where,
                  ": \"quantization_config.quant_method\": ", method.dump(),
                  " is not built; built: \"mxfp4\" (dequantised on load)");
    }
  } else {
    return std::nullopt;
  }
  c.options.num_experts = get_int(experts_key);
  c.options.top_k = get_int("num_experts_per_tok");
  TORCH_CHECK(c.options.num_experts > 0, where, ": \"", experts_key, "\": ", c.options.num_experts,
              " must be positive");
  TORCH_CHECK(c.options.top_k >= 1 && c.options.top_k <= c.options.num_experts, where,
              ": \"num_experts_per_tok\": ", c.options.top_k, " must be in [1, ", experts_key, "=",
              c.options.num_experts, "]");
  TORCH_CHECK(c.expert_hidden_dim > 0, where, ": the experts' intermediate size ",
              c.expert_hidden_dim, " must be positive");
  TORCH_CHECK(c.options.swiglu_limit > 0, where, ": \"swiglu_limit\": ", c.options.swiglu_limit,
              " must be positive");
  c.router_aux_loss_coef = get_double("router_aux_loss_coef", 0.001);
  c.output_router_logits = get_bool("output_router_logits", false);
  int64_t step = 1;
  std::vector<int64_t> dense;
  if (architecture == "Qwen3MoeForCausalLM") {
    if (has("decoder_sparse_step")) step = get_int("decoder_sparse_step");
    TORCH_CHECK(step >= 1, where, ": \"decoder_sparse_step\": ", step, " must be positive");
    if (has("mlp_only_layers")) {
      const json& m = j.at("mlp_only_layers");
      TORCH_CHECK(m.is_array(), where, ": \"mlp_only_layers\" must be a list, got ", m.dump());
      for (const auto& i : m) {
        TORCH_CHECK(i.is_number_integer() && i.get<int64_t>() >= 0 && i.get<int64_t>() < n_layers,
                    where, ": \"mlp_only_layers\" holds ", i.dump(), ", which is not one of the ",
                    n_layers, " layers");
        dense.push_back(i.get<int64_t>());
      }
    }
  }
  c.sparse_layers = sparse_layers(n_layers, c.options.num_experts, step, dense);
  return c;
}

}  // namespace detail

std::optional<HfMoeConfig> read_hf_moe_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open Hugging Face config '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "Hugging Face config '", path, "' is not valid JSON: ", e.what());
  }
  std::string architecture;
  if (j.contains("architectures") && j.at("architectures").is_array() &&
      !j.at("architectures").empty() && j.at("architectures")[0].is_string())
    architecture = j.at("architectures")[0].get<std::string>();
  const int64_t layers =
      j.contains("num_hidden_layers") && j.at("num_hidden_layers").is_number_integer()
          ? j.at("num_hidden_layers").get<int64_t>()
          : 0;
  return detail::parse_hf_moe_config(j, path, architecture, layers);
}

}  // namespace dtensor::models
