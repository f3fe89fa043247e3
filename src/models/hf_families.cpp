// The Hugging Face decoder families as data (hf_families.h): the family table, config.json read
// into / written from DecoderConfig, and the parameters' HF names (from parameter_schema.h).
#include "hf_families.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "dtensor/models/hf_checkpoint.h"
#include "hf_moe_config_json.h"
#include "parameter_schema.h"

namespace dtensor::models {

namespace detail {

using nlohmann::json;

const std::vector<HfFamily>& hf_families() {
  static const std::vector<HfFamily> families{
      // architecture, model_type, attention_bias key, q/k/v bias, q/k norm, sliding layers
      {"LlamaForCausalLM", "llama", true, false, false, WindowRule::kNone},
      {"Qwen3ForCausalLM", "qwen3", true, false, true, WindowRule::kFromMaxWindowLayers},
      {"Qwen2ForCausalLM", "qwen2", false, true, false, WindowRule::kFromMaxWindowLayers},
      {"MistralForCausalLM", "mistral", false, false, false, WindowRule::kEveryLayer},
      {"Gemma3ForCausalLM", "gemma3_text", true, false, true, WindowRule::kPattern, true},
      {"Qwen3MoeForCausalLM", "qwen3_moe", true, false, true, WindowRule::kFromMaxWindowLayers,
       false, &kQwen3MoeExperts},
      {"MixtralForCausalLM", "mixtral", false, false, false, WindowRule::kEveryLayer, false,
       &kMixtralExperts},
      {"GptOssForCausalLM", "gpt_oss", true, false, false, WindowRule::kAlternate, false,
       &kGptOssExperts, /*sinks=*/true},
  };
  return families;
}

namespace {

// Keys of features that are not built: present with a value other than null, 0 or false, the
// config is refused naming the key and its value.
const std::vector<std::pair<const char*, const char*>>& unbuilt_keys() {
  static const std::vector<std::pair<const char*, const char*>> keys{
      {"num_experts", "mixture-of-experts layers"},
      {"num_local_experts", "mixture-of-experts layers"},
      {"n_routed_experts", "mixture-of-experts layers"},
      {"moe_intermediate_size", "mixture-of-experts layers"},
      {"num_experts_per_tok", "mixture-of-experts layers"},
      {"mlp_bias", "biases in the MLP"},
      {"attn_logit_softcapping", "attention logit soft-capping"},
      {"final_logit_softcapping", "final logit soft-capping"},
      {"query_pre_attn_scalar", "a query scale other than 1/sqrt(head_dim)"},
      {"linear_attention_layers", "linear attention"},
      {"use_bidirectional_attention", "bidirectional attention"},
  };
  return keys;
}

bool is_set(const json& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0;
  return true;
}

c10::ScalarType dtype_of_name(const std::string& name, const std::string& where) {
  if (name == "float32" || name == "float") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16" || name == "half") return at::kHalf;
  if (name == "float64" || name == "double") return at::kDouble;
  TORCH_CHECK(false, where, ": dtype \"", name,
              "\" is not supported; expected float32, bfloat16, float16 or float64");
}

std::string supported_architectures() {
  std::vector<std::string> names;
  for (const auto& f : hf_families()) names.emplace_back(f.architecture);
  return c10::Join(", ", names);
}

}  // namespace

HfConfigRead parse_hf_config(const json& j, const std::string& path) {
  const std::string where = "Hugging Face config '" + path + "'";
  auto has = [&](const char* key) { return j.contains(key) && !j.at(key).is_null(); };
  auto get_int = [&](const char* key) -> int64_t {
    TORCH_CHECK(has(key) && j.at(key).is_number_integer(), where, ": \"", key,
                "\" must be an integer");
    return j.at(key).get<int64_t>();
  };
  auto get_bool = [&](const char* key) -> bool {
    if (!has(key)) return false;
    TORCH_CHECK(j.at(key).is_boolean(), where, ": \"", key, "\" must be true or false, got ",
                j.at(key).dump());
    return j.at(key).get<bool>();
  };
  auto get_double = [&](const json& o, const char* key, const std::string& in) -> double {
    TORCH_CHECK(o.contains(key) && o.at(key).is_number(), where, ": \"", in, key,
                "\" must be a number");
    return o.at(key).get<double>();
  };

  const HfFamily* family = nullptr;
  if (has("architectures")) {
    TORCH_CHECK(j.at("architectures").is_array(), where, ": \"architectures\" must be a list");
    std::vector<std::string> archs;
    for (const auto& a : j.at("architectures"))
      archs.push_back(a.is_string() ? a.get<std::string>() : a.dump());
    for (const auto& f : hf_families())
      for (const auto& a : archs) family = family ? family : (a == f.architecture ? &f : nullptr);
    TORCH_CHECK(family, where, ": architecture ", c10::Join(", ", archs),
                " is not supported; supported: ", supported_architectures());
  } else {
    const std::string type = has("model_type") ? j.at("model_type").dump() : "(none)";
    for (const auto& f : hf_families())
      if (has("model_type") && j.at("model_type") == f.model_type) family = &f;
    TORCH_CHECK(family, where, ": no \"architectures\", and \"model_type\" ", type,
                " is not one of the supported families: ", supported_architectures());
  }
  for (const auto& [key, what] : unbuilt_keys()) {
    // Gemma reads these below.
    if (family->gemma && (std::string(key) == "query_pre_attn_scalar" ||
                          std::string(key) == "final_logit_softcapping"))
      continue;
    // The mixture-of-experts families read theirs below.
    if (family->experts && std::string(what) == "mixture-of-experts layers") continue;
    TORCH_CHECK(!j.contains(key) || !is_set(j.at(key)), where, ": \"", key,
                "\": ", j.at(key).dump(), " asks for ", what, ", which is not built");
  }
  if (has("partial_rotary_factor")) {
    TORCH_CHECK(get_double(j, "partial_rotary_factor", "") == 1.0, where,
                ": \"partial_rotary_factor\": ", j.at("partial_rotary_factor").dump(),
                " (rotary on part of each head) is not built");
  }
  if (family->gemma) {
    // Gemma reads hidden_activation (transformers ignores a hidden_act beside it).
    const std::string act =
        has("hidden_activation") ? j.at("hidden_activation").dump() : "\"gelu_pytorch_tanh\"";
    TORCH_CHECK(act == "\"gelu_pytorch_tanh\"", where, ": \"hidden_activation\": ", act,
                " is not supported; Gemma's GeGLU uses \"gelu_pytorch_tanh\"");
  } else if (has("hidden_act")) {
    const auto act = j.at("hidden_act").get<std::string>();
    TORCH_CHECK(act == "silu", where, ": \"hidden_act\": \"", act,
                "\" is not supported; the model uses SwiGLU (\"silu\")");
  }

  HfConfigRead out{DecoderConfig{}, family, at::kFloat};
  DecoderConfig& c = out.config;
  c.vocab_size = get_int("vocab_size");
  c.dim = get_int("hidden_size");
  c.n_layers = get_int("num_hidden_layers");
  c.n_heads = get_int("num_attention_heads");
  c.n_kv_heads = has("num_key_value_heads") ? get_int("num_key_value_heads") : c.n_heads;
  c.ffn_hidden_dim = get_int("intermediate_size");
  c.max_seq_len = has("max_position_embeddings") ? get_int("max_position_embeddings") : 2048;
  c.norm_eps = has("rms_norm_eps") ? get_double(j, "rms_norm_eps", "") : 1e-6;
  // Gemma ties its embedding unless told otherwise (Gemma3TextConfig's default).
  c.tie_embeddings =
      family->gemma && !has("tie_word_embeddings") ? true : get_bool("tie_word_embeddings");
  if (has("head_dim")) c.head_size = get_int("head_dim");
  if (family->attention_bias_key) {
    c.qkv_bias = c.wo_bias = get_bool("attention_bias");
  } else {
    TORCH_CHECK(!has("attention_bias") || get_bool("attention_bias") == family->qkv_bias, where,
                ": \"attention_bias\": ", j.at("attention_bias").dump(), " disagrees with ",
                family->architecture, ", whose q/k/v biases are fixed");
    c.qkv_bias = family->qkv_bias;
  }
  c.qk_norm = family->qk_norm;
  if (family->gemma) {
    c.norm_weight_offset = 1;
    c.post_norms = true;
    c.scale_embeddings = true;
    c.activation = "gelu_tanh";
    c.query_pre_attn_scalar = has("query_pre_attn_scalar")
                                  ? get_double(j, "query_pre_attn_scalar", "")
                                  : 256.0;  // Gemma3TextConfig's default
    if (has("final_logit_softcapping"))
      c.final_logit_softcap = get_double(j, "final_logit_softcapping", "");
    TORCH_CHECK(c.query_pre_attn_scalar > 0, where,
                ": \"query_pre_attn_scalar\": ", j.at("query_pre_attn_scalar").dump(),
                " must be positive");
  }

  // Sliding windows: "layer_types" when present (transformers 5 writes it), else the family's
  // rule; Qwen's sliding_window only counts with use_sliding_window (as transformers reads it).
  const bool qwen_rule = family->window == WindowRule::kFromMaxWindowLayers;
  if (has("sliding_window") && (!qwen_rule || get_bool("use_sliding_window")))
    c.sliding_window = get_int("sliding_window");
  else if (family->window == WindowRule::kPattern && !j.contains("sliding_window"))
    c.sliding_window = 4096;  // Gemma3TextConfig's default
  if (has("layer_types")) {
    TORCH_CHECK(j.at("layer_types").is_array(), where, ": \"layer_types\" must be a list");
    for (const auto& t : j.at("layer_types")) {
      TORCH_CHECK(t == "full_attention" || t == "sliding_attention", where,
                  ": \"layer_types\" holds ", t.dump(),
                  ", which is not built; supported: \"full_attention\", \"sliding_attention\"");
      c.sliding_layers.push_back(t == "sliding_attention");
    }
  } else if (qwen_rule && c.sliding_window > 0) {
    const int64_t first = has("max_window_layers") ? get_int("max_window_layers") : 28;
    for (int64_t i = 0; i < c.n_layers; ++i) c.sliding_layers.push_back(i >= first);
  } else if (family->window == WindowRule::kPattern) {
    // transformers 4: every pattern-th layer is global, the others slide.
    int64_t pattern = 6;
    for (const char* key : {"sliding_window_pattern", "_sliding_window_pattern"})
      if (has(key)) pattern = get_int(key);
    TORCH_CHECK(pattern > 0, where, ": \"sliding_window_pattern\": ", pattern, " must be positive");
    for (int64_t i = 0; i < c.n_layers; ++i) c.sliding_layers.push_back((i + 1) % pattern != 0);
  } else if (family->window == WindowRule::kAlternate && c.sliding_window > 0) {
    for (int64_t i = 0; i < c.n_layers; ++i) c.sliding_layers.push_back(i % 2 == 0);
  } else if (family->window == WindowRule::kNone) {
    TORCH_CHECK(c.sliding_window == 0, where, ": \"sliding_window\": ", c.sliding_window, " with ",
                family->architecture, ", which has no sliding layers");
  }

  // layer_types of full layers only (as transformers 5 writes for every Qwen): no window.
  if (c.sliding_window == 0 &&
      std::none_of(c.sliding_layers.begin(), c.sliding_layers.end(), [](bool s) { return s; }))
    c.sliding_layers.clear();

  // Only the plain rotary of a Gemma layer type is built: {"rope_type": "default", ...}.
  auto gemma_rope = [&](const json& r, const std::string& key) -> std::optional<double> {
    TORCH_CHECK(r.is_object(), where, ": \"", key, "\" must be an object");
    for (const char* type_key : {"rope_type", "type"}) {
      if (!r.contains(type_key)) continue;
      const json& type = r.at(type_key);
      TORCH_CHECK(type == "default", where, ": \"", key, ".", type_key, "\": rope type ",
                  type.dump(), " is not supported; supported: default");
    }
    if (!r.contains("rope_theta")) return std::nullopt;
    return get_double(r, "rope_theta", key + ".");
  };
  if (family->gemma) {
    // transformers 4: rope_theta (global layers), rope_local_base_freq (sliding ones) and
    // rope_scaling (global); 5: rope_parameters {"full_attention": {...}, "sliding_attention":
    // {...}}. Defaults as Gemma3TextConfig's.
    c.rope_theta = has("rope_theta") ? get_double(j, "rope_theta", "") : 1e6;
    c.rope_local_theta =
        has("rope_local_base_freq") ? get_double(j, "rope_local_base_freq", "") : 1e4;
    if (has("rope_scaling")) gemma_rope(j.at("rope_scaling"), "rope_scaling");
    if (has("rope_parameters")) {
      const json& rp = j.at("rope_parameters");
      TORCH_CHECK(rp.is_object(), where, ": \"rope_parameters\" must be an object");
      for (const auto& [type, r] : rp.items()) {
        TORCH_CHECK(type == "full_attention" || type == "sliding_attention", where,
                    ": \"rope_parameters\" holds \"", type,
                    "\"; Gemma's has \"full_attention\" and \"sliding_attention\"");
        if (r.is_null()) continue;
        const auto theta = gemma_rope(r, "rope_parameters." + type);
        if (theta) (type == "full_attention" ? c.rope_theta : c.rope_local_theta) = *theta;
      }
    }
  }

  // transformers 4 writes rope_theta and rope_scaling, 5 rope_parameters (theta included).
  json rope = json::object();
  std::string rope_key = "rope_scaling.";
  if (family->gemma) {
    // read above
  } else if (has("rope_parameters")) {
    rope = j.at("rope_parameters");
    rope_key = "rope_parameters.";
  } else if (has("rope_scaling")) {
    rope = j.at("rope_scaling");
  }
  TORCH_CHECK(rope.is_object(), where, ": \"", rope_key.substr(0, rope_key.size() - 1),
              "\" must be an object");
  if (!family->gemma) {
    c.rope_theta = has("rope_theta")             ? get_double(j, "rope_theta", "")
                   : rope.contains("rope_theta") ? get_double(rope, "rope_theta", rope_key)
                                                 : 10000.0;
  }
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (rope.contains(key)) type = rope.at(key).get<std::string>();
  }
  if (type == "llama3") {
    Llama3RopeScaling s;
    s.factor = get_double(rope, "factor", rope_key);
    s.low_freq_factor = get_double(rope, "low_freq_factor", rope_key);
    s.high_freq_factor = get_double(rope, "high_freq_factor", rope_key);
    s.original_max_position_embeddings =
        static_cast<int64_t>(get_double(rope, "original_max_position_embeddings", rope_key));
    c.rope_scaling = s;
  } else if (type == "yarn" && !family->gemma) {
    YarnRopeScaling s;
    s.factor = get_double(rope, "factor", rope_key);
    auto optional = [&](const char* key, double otherwise) {
      return rope.contains(key) && !rope.at(key).is_null() ? get_double(rope, key, rope_key)
                                                           : otherwise;
    };
    s.beta_fast = optional("beta_fast", 32);
    s.beta_slow = optional("beta_slow", 1);
    s.mscale = optional("mscale", 0);
    s.mscale_all_dim = optional("mscale_all_dim", 0);
    s.original_max_position_embeddings = static_cast<int64_t>(
        optional("original_max_position_embeddings", static_cast<double>(c.max_seq_len)));
    if (rope.contains("attention_factor") && !rope.at("attention_factor").is_null())
      s.attention_factor = get_double(rope, "attention_factor", rope_key);
    if (rope.contains("truncate")) {
      TORCH_CHECK(rope.at("truncate").is_boolean(), where, ": \"", rope_key,
                  "truncate\" must be true or false");
      s.truncate = rope.at("truncate").get<bool>();
    }
    c.rope_yarn = s;
  } else {
    TORCH_CHECK(type == "default", where, ": \"", rope_key, "rope_type\": rope type \"", type,
                "\" is not supported; supported: default, llama3, yarn");
  }
  if (family->experts) {
    const auto moe = parse_hf_moe_config(j, path, family->architecture, c.n_layers);
    TORCH_CHECK(moe, where, ": ", family->architecture, " has no mixture-of-experts reader");
    DecoderMoe m;
    m.options = moe->options;
    m.expert_hidden_dim = moe->expert_hidden_dim;
    m.sparse_layers = moe->sparse_layers;
    m.router_aux_loss_coef = moe->router_aux_loss_coef;
    c.moe = m;
  }
  c.attention_sinks = family->sinks;
  c.norm_scale_in_float32 = family->sinks;  // gpt-oss's norms ("main diff with Llama")
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (has(key)) out.dtype = dtype_of_name(j.at(key).get<std::string>(), where);
  }
  try {
    c.validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": ", e.msg());
  }
  return out;
}

namespace {

// Whether the Gemma features of `c` are all Gemma's (gemma) or all absent (the others).
bool block_is(const DecoderConfig& c, bool gemma) {
  if (gemma) {
    return c.norm_weight_offset == 1 && c.post_norms && c.scale_embeddings &&
           c.activation == "gelu_tanh" && !c.rope_scaling;
  }
  return c.norm_weight_offset == 0 && !c.post_norms && !c.scale_embeddings &&
         c.activation == "silu" && c.query_pre_attn_scalar == 0 && c.final_logit_softcap == 0 &&
         (c.rope_local_theta == 0 || c.rope_local_theta == c.rope_theta);
}

// A number as an integer when it is one (transformers checks some keys' types strictly).
json number(double x) {
  return std::floor(x) == x && std::abs(x) < 1e15 ? json(static_cast<int64_t>(x)) : json(x);
}

// Whether the experts of `c` are the ones the family with `layout` has (routing, biases,
// activation, which layers are sparse).
bool experts_are(const DecoderConfig& c, const HfExpertLayout& layout) {
  const MoeOptions& o = c.moe->options;
  bool every_layer = true;
  for (int64_t l = 0; l < c.n_layers; ++l) every_layer = every_layer && c.sparse(l);
  const bool softmax = o.scoring == RouterScoring::kSoftmaxThenTopK;
  const bool swiglu = o.activation == ExpertActivation::kSwiGLU;
  if (&layout == &kQwen3MoeExperts)
    return softmax && !o.float32_weights && !o.router_bias && !o.expert_bias && swiglu;
  if (&layout == &kMixtralExperts)
    return softmax && o.renormalize && o.float32_weights && !o.router_bias && !o.expert_bias &&
           swiglu && every_layer;
  return !softmax && o.router_bias && o.expert_bias && !swiglu && every_layer;
}

}  // namespace

const HfExpertLayout& hf_expert_layout_for(const DecoderConfig& config) {
  const HfFamily& f = hf_family_for(config);
  TORCH_CHECK(f.experts, "Hugging Face family ", f.architecture, " has no experts");
  return *f.experts;
}

const HfFamily& hf_family_for(const DecoderConfig& c) {
  bool every_layer_slides = true;
  for (bool s : c.sliding_layers) every_layer_slides = every_layer_slides && s;
  for (const auto& f : hf_families()) {
    if (f.qk_norm != c.qk_norm || !block_is(c, f.gemma)) continue;
    if ((f.experts != nullptr) != c.has_moe() || f.sinks != c.attention_sinks ||
        f.sinks != c.norm_scale_in_float32)
      continue;
    if (f.experts && !experts_are(c, *f.experts)) continue;
    if (f.attention_bias_key ? c.qkv_bias != c.wo_bias : (c.qkv_bias != f.qkv_bias || c.wo_bias))
      continue;
    if (f.window == WindowRule::kNone && c.sliding_window > 0) continue;
    if (f.window == WindowRule::kEveryLayer && c.sliding_window > 0 && !every_layer_slides)
      continue;
    return f;
  }
  TORCH_CHECK(false, "save_hf: no Hugging Face family expresses this configuration (", c.to_json(),
              "); supported: ", supported_architectures());
}

std::string hf_config_json(const DecoderConfig& c, const HfFamily& f, const std::string& dtype) {
  nlohmann::ordered_json j;
  j["architectures"] = {f.architecture};
  j["model_type"] = f.model_type;
  if (f.attention_bias_key) j["attention_bias"] = c.qkv_bias;
  if (std::string(f.model_type) == "llama") j["mlp_bias"] = false;
  const bool gemma = f.gemma;
  j[gemma ? "hidden_activation" : "hidden_act"] = gemma ? "gelu_pytorch_tanh" : "silu";
  j["hidden_size"] = c.dim;
  // Mixtral's and gpt-oss's intermediate_size is the experts' width (they have no dense layer).
  const bool experts_width = f.experts && f.experts != &kQwen3MoeExperts;
  j["intermediate_size"] = experts_width ? c.moe->expert_hidden_dim : c.hidden_dim();
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.kv_heads();
  j["head_dim"] = c.head_dim();
  j["max_position_embeddings"] = c.max_seq_len;
  j["rms_norm_eps"] = c.norm_eps;
  if (gemma) {
    // Both spellings: transformers 4 reads rope_theta and rope_local_base_freq, 5
    // rope_parameters per layer type.
    const double local = c.rope_local_theta > 0 ? c.rope_local_theta : c.rope_theta;
    j["query_pre_attn_scalar"] = number(
        c.query_pre_attn_scalar > 0 ? c.query_pre_attn_scalar : static_cast<double>(c.head_dim()));
    j["rope_local_base_freq"] = local;
    j["rope_parameters"] = {
        {"full_attention", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
        {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", local}}}};
    j["attn_logit_softcapping"] = nullptr;
    j["final_logit_softcapping"] =
        c.final_logit_softcap > 0 ? json(c.final_logit_softcap) : json(nullptr);
  }
  j["rope_theta"] = c.rope_theta;
  if (c.rope_yarn) {
    const YarnRopeScaling& y = *c.rope_yarn;
    j["rope_scaling"] = {{"rope_type", "yarn"},
                         {"rope_theta", c.rope_theta},
                         {"factor", y.factor},
                         {"beta_fast", y.beta_fast},
                         {"beta_slow", y.beta_slow},
                         {"original_max_position_embeddings", y.original_max_position_embeddings},
                         {"truncate", y.truncate}};
    if (y.attention_factor) j["rope_scaling"]["attention_factor"] = *y.attention_factor;
    if (y.mscale != 0) j["rope_scaling"]["mscale"] = y.mscale;
    if (y.mscale_all_dim != 0) j["rope_scaling"]["mscale_all_dim"] = y.mscale_all_dim;
    // transformers 5 reads rope_parameters.
    j["rope_parameters"] = j["rope_scaling"];
  } else if (c.rope_scaling) {
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", c.rope_scaling->factor},
        {"low_freq_factor", c.rope_scaling->low_freq_factor},
        {"high_freq_factor", c.rope_scaling->high_freq_factor},
        {"original_max_position_embeddings", c.rope_scaling->original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  if (f.window != WindowRule::kNone) {
    j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  }
  if (f.window == WindowRule::kPattern || f.window == WindowRule::kAlternate) {
    std::vector<std::string> types;
    for (int64_t i = 0; i < c.n_layers; ++i)
      types.emplace_back(c.window(i) > 0 ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  }
  if (f.window == WindowRule::kFromMaxWindowLayers) {
    // transformers 4 reads use_sliding_window and max_window_layers, 5 layer_types.
    int64_t first = c.n_layers;
    std::vector<std::string> types;
    for (int64_t i = 0; i < c.n_layers; ++i) {
      const bool slides = c.window(i) > 0;
      if (slides) first = std::min(first, i);
      types.emplace_back(slides ? "sliding_attention" : "full_attention");
    }
    j["use_sliding_window"] = c.sliding_window > 0;
    j["max_window_layers"] = first;
    j["layer_types"] = types;
  }
  if (f.experts) {
    const MoeOptions& o = c.moe->options;
    const bool qwen = f.experts == &kQwen3MoeExperts;
    j[qwen ? "num_experts" : "num_local_experts"] = o.num_experts;
    j["num_experts_per_tok"] = o.top_k;
    if (qwen) {
      std::vector<int64_t> dense;
      for (int64_t l = 0; l < c.n_layers; ++l)
        if (!c.sparse(l)) dense.push_back(l);
      j["moe_intermediate_size"] = c.moe->expert_hidden_dim;
      j["norm_topk_prob"] = o.renormalize;
      j["decoder_sparse_step"] = 1;
      j["mlp_only_layers"] = dense;
    }
    if (f.experts == &kMixtralExperts) j["router_jitter_noise"] = 0.0;
    if (f.experts == &kGptOssExperts) {
      j["swiglu_alpha"] = o.swiglu_alpha;
      j["swiglu_limit"] = o.swiglu_limit;
    }
    j["router_aux_loss_coef"] = c.moe->router_aux_loss_coef;
    j["output_router_logits"] = false;
  }
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["torch_dtype"] = dtype;
  j["vocab_size"] = c.vocab_size;
  return j.dump(2) + "\n";
}

bool has_rotary_rows(const std::string& name) {
  const auto found = find_parameter_row(name);
  return found && found->row->rotary_rows;
}

}  // namespace detail

std::string hf_parameter_name(const std::string& name, const DecoderConfig& config) {
  const auto found = detail::find_parameter_row(name);
  TORCH_CHECK(found, "parameter \"", name, "\" has no Hugging Face counterpart");
  const detail::ParameterRow& row = *found->row;
  TORCH_CHECK(row.hf != nullptr, "parameter \"", name,
              "\" (stacked experts) has no single Hugging Face tensor; see hf_expert_tensors");
  if (row.role == detail::Role::kRouter || row.role == detail::Role::kRouterBias) {
    const HfExpertLayout& layout = detail::hf_expert_layout_for(config);
    return hf_expert_prefix(layout, found->layer) + layout.router + "." + row.hf;
  }
  const std::string hf = config.post_norms && row.hf_post_norms ? row.hf_post_norms : row.hf;
  if (found->layer < 0) return hf;
  return "model.layers." + std::to_string(found->layer) + "." + hf;
}

}  // namespace dtensor::models
