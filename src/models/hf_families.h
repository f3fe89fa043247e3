#pragma once
// The Hugging Face decoder families the loader and the saver know, as data: what each
// architecture's config.json means for DecoderConfig, and one table of parameter names shared by
// all of them (docs/ARCHITECTURE.md, "One decoder, many families": adding a family is a row
// here, its name-table entries if it has new parameters, and a fixture test).
#include <c10/core/ScalarType.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtensor/models/hf_experts.h"
#include "dtensor/models/transformer.h"

namespace dtensor::models::detail {

// Which layers slide when config.json has no "layer_types".
enum class WindowRule {
  kNone,                 // no sliding window (Llama)
  kEveryLayer,           // sliding_window on every layer (Mistral)
  kFromMaxWindowLayers,  // use_sliding_window: layers >= max_window_layers (Qwen2, Qwen3)
  kPattern,              // all but every sliding_window_pattern-th layer (Gemma 3; default 6)
  kAlternate,            // even layers slide, odd ones are full (gpt-oss)
};

struct HfFamily {
  const char* architecture;  // "Qwen3ForCausalLM"
  const char* model_type;    // "qwen3"
  bool attention_bias_key;   // "attention_bias" puts biases on q, k, v and o (Llama, Qwen3)
  bool qkv_bias;             // q, k and v always have biases, o none (Qwen2)
  bool qk_norm;              // per-head q_norm / k_norm (Qwen3)
  WindowRule window;
  // Gemma's block: (1 + w) norms, a norm after each sublayer too, embeddings times sqrt(hidden),
  // GeGLU (hidden_activation), query_pre_attn_scalar, a rope base per layer type, tied embedding
  // by default.
  bool gemma = false;
  // A mixture-of-experts family: where its checkpoints keep the experts (hf_experts.h); null for
  // the dense ones.
  const HfExpertLayout* experts = nullptr;
  // gpt-oss's attention: per-head sinks.
  bool sinks = false;
};

// Every family, Llama first.
const std::vector<HfFamily>& hf_families();

// config.json (parsed from `path`) as a DecoderConfig, the family it names, and the stored
// dtype; throws naming the file, the key and its value for what is not built.
struct HfConfigRead {
  DecoderConfig config;
  const HfFamily* family;
  c10::ScalarType dtype;
};
HfConfigRead parse_hf_config(const nlohmann::json& j, const std::string& path);

// The family save_hf writes `config` as (the first that can express it); throws when none.
const HfFamily& hf_family_for(const DecoderConfig& config);

// config.json for `config` as `family` (transformers 4's spelling, which 5 reads as well).
std::string hf_config_json(const DecoderConfig& config, const HfFamily& family,
                           const std::string& dtype_name);

// The expert layout of the MoE family save_hf writes `config` as (hf_family_for's).
const HfExpertLayout& hf_expert_layout_for(const DecoderConfig& config);

// Whether our parameter `name` holds per-head rows in rotary order (q/k weights, biases and
// norms): HF stores them rotate-half, we interleave pairs.
bool has_rotary_rows(const std::string& name);

}  // namespace dtensor::models::detail
