// DecoderConfig: presets, derived sizes, validation and a flat JSON form.
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <string>

#include "dtensor/models/transformer.h"

namespace dtensor::models {

DecoderConfig DecoderConfig::preset(const std::string& name) {
  DecoderConfig c;
  if (name == "tiny" || name == "tiny-moe") {
    // Tests: GQA (2 KV heads for 4 query heads), every size divisible by 1, 2 and 4.
    c.vocab_size = 256;
    c.dim = 32;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.max_seq_len = 64;
    if (name == "tiny-moe") {
      // Qwen3-MoE's routing (softmax, top 2 renormalised) over 4 experts of width 16.
      DecoderMoe moe;
      moe.options.num_experts = 4;
      moe.options.top_k = 2;
      moe.options.renormalize = true;
      moe.expert_hidden_dim = 16;
      moe.router_aux_loss_coef = 0.01;
      c.moe = moe;
    }
  } else if (name == "demo") {
    // ~3.1M parameters: a byte-level model that learns visibly in a minute on 2 CPU cores.
    c.vocab_size = 256;
    c.dim = 256;
    c.n_layers = 4;
    c.n_heads = 8;
    c.n_kv_heads = 4;
    c.max_seq_len = 256;
  } else if (name == "bench") {
    // ~29M parameters: big enough that matmuls, not dispatch, dominate a step.
    c.vocab_size = 4096;
    c.dim = 512;
    c.n_layers = 8;
    c.n_heads = 8;
    c.n_kv_heads = 4;
    c.multiple_of = 256;
    c.max_seq_len = 512;
  } else {
    TORCH_CHECK(false, "unknown model preset '", name,
                "'; presets: ", c10::Join(", ", preset_names()));
  }
  return c;
}

std::vector<std::string> DecoderConfig::preset_names() {
  return {"tiny", "tiny-moe", "demo", "bench"};
}

bool DecoderConfig::sparse(int64_t layer) const {
  if (!moe) return false;
  if (moe->sparse_layers.empty()) return true;
  return moe->sparse_layers.at(static_cast<size_t>(layer));
}

bool DecoderConfig::has_moe() const {
  for (int64_t l = 0; l < n_layers; ++l)
    if (sparse(l)) return true;
  return false;
}

int64_t DecoderConfig::kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }

int64_t DecoderConfig::head_dim() const { return head_size > 0 ? head_size : dim / n_heads; }

int64_t DecoderConfig::window(int64_t layer) const {
  if (sliding_window <= 0) return 0;
  if (sliding_layers.empty()) return sliding_window;
  return sliding_layers.at(static_cast<size_t>(layer)) ? sliding_window : 0;
}

double DecoderConfig::rope_base(int64_t layer) const {
  return layer >= 0 && window(layer) > 0 && rope_local_theta > 0 ? rope_local_theta : rope_theta;
}

double DecoderConfig::attention_scale() const {
  const double d =
      query_pre_attn_scalar > 0 ? query_pre_attn_scalar : static_cast<double>(head_dim());
  return 1.0 / std::sqrt(d);
}

int64_t DecoderConfig::hidden_dim() const {
  if (ffn_hidden_dim > 0) return ffn_hidden_dim;
  // Llama: 2/3 of 4*dim, scaled by ffn_dim_multiplier, rounded up to multiple_of.
  int64_t hidden = 2 * (4 * dim) / 3;
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * hidden);
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

int64_t DecoderConfig::num_parameters() const {
  const int64_t hd = head_dim();
  int64_t attention = dim * n_heads * hd + 2 * dim * kv_heads() * hd + n_heads * hd * dim;
  if (qkv_bias) attention += (n_heads + 2 * kv_heads()) * hd;
  if (wo_bias) attention += dim;
  if (qk_norm) attention += 2 * hd;
  if (attention_sinks) attention += n_heads;
  const int64_t dense = 3 * dim * hidden_dim();
  int64_t blocks = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    int64_t ffn = dense;
    if (sparse(l)) {
      const MoeOptions& o = moe->options;
      const int64_t I = moe->expert_hidden_dim;
      ffn = o.num_experts * (3 * dim * I + (o.expert_bias ? 2 * I + dim : 0)) +
            o.num_experts * dim + (o.router_bias ? o.num_experts : 0);
    }
    blocks += attention + ffn + (post_norms ? 4 : 2) * dim;
  }
  const int64_t embed = vocab_size * dim;
  return embed + blocks + dim + (tie_embeddings ? 0 : embed);
}

void DecoderConfig::validate() const {
  TORCH_CHECK(vocab_size > 0, "DecoderConfig: vocab_size must be positive, got ", vocab_size);
  TORCH_CHECK(dim > 0, "DecoderConfig: dim must be positive, got ", dim);
  TORCH_CHECK(n_layers >= 0, "DecoderConfig: n_layers must be >= 0, got ", n_layers);
  TORCH_CHECK(n_heads > 0, "DecoderConfig: n_heads must be positive, got ", n_heads);
  TORCH_CHECK(head_size >= 0, "DecoderConfig: head_size must be >= 0 (0 means dim / n_heads), got ",
              head_size);
  TORCH_CHECK(head_size > 0 || dim % n_heads == 0, "DecoderConfig: dim=", dim,
              " is not divisible by n_heads=", n_heads, "; set head_size");
  TORCH_CHECK(head_dim() % 2 == 0, "DecoderConfig: head_dim=", head_dim(),
              " must be even for rotary embeddings");
  TORCH_CHECK(dropout >= 0 && dropout < 1, "DecoderConfig: dropout must be in [0, 1), got ",
              dropout);
  TORCH_CHECK(sliding_window >= 0, "DecoderConfig: sliding_window must be >= 0 (0: none), got ",
              sliding_window);
  TORCH_CHECK(sliding_layers.empty() || static_cast<int64_t>(sliding_layers.size()) == n_layers,
              "DecoderConfig: sliding_layers has ", sliding_layers.size(),
              " entries for n_layers=", n_layers);
  TORCH_CHECK(n_kv_heads >= 0, "DecoderConfig: n_kv_heads must be >= 0 (0 means n_heads), got ",
              n_kv_heads);
  TORCH_CHECK(n_heads % kv_heads() == 0, "DecoderConfig: n_heads=", n_heads,
              " is not divisible by n_kv_heads=", kv_heads());
  TORCH_CHECK(ffn_hidden_dim >= 0, "DecoderConfig: ffn_hidden_dim must be >= 0 (0 means derived)");
  TORCH_CHECK(multiple_of > 0, "DecoderConfig: multiple_of must be positive, got ", multiple_of);
  TORCH_CHECK(!ffn_dim_multiplier || *ffn_dim_multiplier > 0,
              "DecoderConfig: ffn_dim_multiplier must be positive");
  TORCH_CHECK(hidden_dim() > 0, "DecoderConfig: the FFN hidden size must be positive");
  TORCH_CHECK(max_seq_len > 0, "DecoderConfig: max_seq_len must be positive, got ", max_seq_len);
  TORCH_CHECK(norm_eps > 0, "DecoderConfig: norm_eps must be positive, got ", norm_eps);
  TORCH_CHECK(rope_theta > 0, "DecoderConfig: rope_theta must be positive, got ", rope_theta);
  TORCH_CHECK(rope_local_theta >= 0,
              "DecoderConfig: rope_local_theta must be >= 0 (0: rope_theta), got ",
              rope_local_theta);
  TORCH_CHECK(query_pre_attn_scalar >= 0,
              "DecoderConfig: query_pre_attn_scalar must be >= 0 (0: head_dim), got ",
              query_pre_attn_scalar);
  TORCH_CHECK(final_logit_softcap >= 0,
              "DecoderConfig: final_logit_softcap must be >= 0 (0: none), got ",
              final_logit_softcap);
  TORCH_CHECK(std::isfinite(norm_weight_offset),
              "DecoderConfig: norm_weight_offset must be finite");
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "DecoderConfig: activation \"",
              activation, "\" is not built; expected \"silu\" or \"gelu_tanh\"");
  if (moe) {
    try {
      moe->options.validate();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "DecoderConfig: moe: ", e.msg());
    }
    TORCH_CHECK(moe->expert_hidden_dim > 0,
                "DecoderConfig: moe.expert_hidden_dim must be positive, got ",
                moe->expert_hidden_dim);
    TORCH_CHECK(
        moe->sparse_layers.empty() || static_cast<int64_t>(moe->sparse_layers.size()) == n_layers,
        "DecoderConfig: moe.sparse_layers has ", moe->sparse_layers.size(),
        " entries for n_layers=", n_layers);
  }
  TORCH_CHECK(!(rope_scaling && rope_yarn),
              "DecoderConfig: rope_scaling (llama3) and rope_yarn exclude each other");
  if (rope_yarn) {
    TORCH_CHECK(rope_yarn->factor > 0 && rope_yarn->original_max_position_embeddings > 0,
                "DecoderConfig: rope_yarn needs a positive factor and "
                "original_max_position_embeddings");
  }
  if (rope_scaling) {
    const auto& r = *rope_scaling;
    TORCH_CHECK(r.factor > 0 && r.low_freq_factor > 0 && r.original_max_position_embeddings > 0,
                "DecoderConfig: rope_scaling needs positive factor, low_freq_factor and "
                "original_max_position_embeddings");
    TORCH_CHECK(r.high_freq_factor > r.low_freq_factor,
                "DecoderConfig: rope_scaling.high_freq_factor (", r.high_freq_factor,
                ") must exceed low_freq_factor (", r.low_freq_factor, ")");
  }
}

std::vector<int64_t> DecoderConfig::valid_tp_degrees() const {
  std::vector<int64_t> out;
  int64_t g = std::gcd(n_heads, hidden_dim());
  if (moe) g = std::gcd(g, moe->expert_hidden_dim);
  for (int64_t d = 1; d <= g; ++d) {
    if (g % d == 0) out.push_back(d);
  }
  return out;
}

void DecoderConfig::validate_tp(int64_t tp) const {
  validate();
  TORCH_CHECK(tp >= 1, "tensor parallel degree must be >= 1, got ", tp);
  auto valid = [this] { return c10::Join(", ", valid_tp_degrees()); };
  // Heads are never split: each rank runs whole heads (the attention infers them from widths).
  TORCH_CHECK(n_heads % tp == 0, "n_heads=", n_heads, " is not divisible by tp=", tp,
              "; valid tp degrees: ", valid());
  // w1/w3 outputs meet w2's row-sharded weight as local tensors, which needs even shards.
  TORCH_CHECK(hidden_dim() % tp == 0, "the FFN hidden size ", hidden_dim(),
              " is not divisible by tp=", tp, "; valid tp degrees: ", valid());
  // Each expert splits like a dense feed-forward (moe.h's apply_tensor_parallel).
  TORCH_CHECK(!moe || moe->expert_hidden_dim % tp == 0, "the experts' hidden size ",
              moe ? moe->expert_hidden_dim : 0, " is not divisible by tp=", tp,
              "; valid tp degrees: ", valid());
}

// ---- JSON ----

namespace {

using nlohmann::json;

int64_t as_int(const std::string& key, const json& v) {
  TORCH_CHECK(v.is_number_integer() ||
                  (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()),
              "DecoderConfig JSON: '", key, "' must be an integer");
  return v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>());
}

double as_double(const std::string& key, const json& v) {
  TORCH_CHECK(v.is_number(), "DecoderConfig JSON: '", key, "' must be a number");
  return v.get<double>();
}

// A flat object; a key given twice is an error (JSON parsers otherwise keep the last).
json parse_object(const std::string& text) {
  std::set<std::string> seen;
  json j;
  try {
    j = json::parse(text, [&](int depth, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::key && depth == 1) {
        const auto key = parsed.get<std::string>();
        TORCH_CHECK(seen.insert(key).second, "DecoderConfig JSON: duplicate key '", key, "'");
      }
      return true;
    });
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "DecoderConfig JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "DecoderConfig JSON: expected an object, got ", j.type_name());
  return j;
}

bool as_bool(const std::string& key, const json& v) {
  TORCH_CHECK(v.is_boolean(), "DecoderConfig JSON: '", key, "' must be true or false");
  return v.get<bool>();
}

std::vector<bool> as_bools(const std::string& key, const json& v) {
  TORCH_CHECK(v.is_array(), "DecoderConfig JSON: '", key, "' must be an array of booleans");
  std::vector<bool> out;
  for (const auto& b : v) out.push_back(as_bool(key, b));
  return out;
}

// The router and activation types by name (config files and --config).
const char* router_name(RouterScoring s) {
  return s == RouterScoring::kSoftmaxThenTopK ? "softmax_topk" : "topk_softmax";
}
const char* expert_activation_name(ExpertActivation a) {
  return a == ExpertActivation::kSwiGLU ? "silu" : "clamped_swiglu";
}

DecoderMoe moe_from_json(const json& v) {
  TORCH_CHECK(v.is_object(), "DecoderConfig JSON: 'moe' must be null or an object");
  DecoderMoe m;
  for (const auto& [k, x] : v.items()) {
    const std::string name = "moe." + k;
    MoeOptions& o = m.options;
    if (k == "num_experts") {
      o.num_experts = as_int(name, x);
    } else if (k == "top_k") {
      o.top_k = as_int(name, x);
    } else if (k == "expert_hidden_dim") {
      m.expert_hidden_dim = as_int(name, x);
    } else if (k == "router") {
      TORCH_CHECK(x == "softmax_topk" || x == "topk_softmax", "DecoderConfig JSON: '", name,
                  "': router type ", x.dump(),
                  " is not built; built: \"softmax_topk\", \"topk_softmax\"");
      o.scoring =
          x == "softmax_topk" ? RouterScoring::kSoftmaxThenTopK : RouterScoring::kTopKThenSoftmax;
    } else if (k == "renormalize") {
      o.renormalize = as_bool(name, x);
    } else if (k == "float32_weights") {
      o.float32_weights = as_bool(name, x);
    } else if (k == "router_bias") {
      o.router_bias = as_bool(name, x);
    } else if (k == "expert_bias") {
      o.expert_bias = as_bool(name, x);
    } else if (k == "activation") {
      TORCH_CHECK(x == "silu" || x == "clamped_swiglu", "DecoderConfig JSON: '", name,
                  "': ", x.dump(), " is not built; built: \"silu\", \"clamped_swiglu\"");
      o.activation = x == "silu" ? ExpertActivation::kSwiGLU : ExpertActivation::kClampedSwiGLU;
    } else if (k == "swiglu_alpha") {
      o.swiglu_alpha = as_double(name, x);
    } else if (k == "swiglu_limit") {
      o.swiglu_limit = as_double(name, x);
    } else if (k == "sparse_layers") {
      m.sparse_layers = as_bools(name, x);
    } else if (k == "router_aux_loss_coef") {
      m.router_aux_loss_coef = as_double(name, x);
    } else {
      TORCH_CHECK(false, "DecoderConfig JSON: unknown key '", name, "'");
    }
  }
  return m;
}

YarnRopeScaling yarn_from_json(const json& v) {
  TORCH_CHECK(v.is_object(), "DecoderConfig JSON: 'rope_yarn' must be null or an object");
  YarnRopeScaling y;
  for (const auto& [k, x] : v.items()) {
    const std::string name = "rope_yarn." + k;
    if (k == "factor") {
      y.factor = as_double(name, x);
    } else if (k == "beta_fast") {
      y.beta_fast = as_double(name, x);
    } else if (k == "beta_slow") {
      y.beta_slow = as_double(name, x);
    } else if (k == "original_max_position_embeddings") {
      y.original_max_position_embeddings = as_int(name, x);
    } else if (k == "truncate") {
      y.truncate = as_bool(name, x);
    } else if (k == "attention_factor") {
      if (x.is_null())
        y.attention_factor.reset();
      else
        y.attention_factor = as_double(name, x);
    } else if (k == "mscale") {
      y.mscale = as_double(name, x);
    } else if (k == "mscale_all_dim") {
      y.mscale_all_dim = as_double(name, x);
    } else {
      TORCH_CHECK(false, "DecoderConfig JSON: unknown key '", name, "'");
    }
  }
  return y;
}

}  // namespace

DecoderConfig DecoderConfig::from_json(const std::string& text) {
  DecoderConfig c;
  const json object = parse_object(text);  // kept alive: items() only views it
  for (const auto& [key, v] : object.items()) {
    if (key == "vocab_size") {
      c.vocab_size = as_int(key, v);
    } else if (key == "dim") {
      c.dim = as_int(key, v);
    } else if (key == "n_layers") {
      c.n_layers = as_int(key, v);
    } else if (key == "n_heads") {
      c.n_heads = as_int(key, v);
    } else if (key == "n_kv_heads") {
      c.n_kv_heads = v.is_null() ? 0 : as_int(key, v);
    } else if (key == "ffn_hidden_dim") {
      c.ffn_hidden_dim = v.is_null() ? 0 : as_int(key, v);
    } else if (key == "multiple_of") {
      c.multiple_of = as_int(key, v);
    } else if (key == "ffn_dim_multiplier") {
      if (v.is_null()) {
        c.ffn_dim_multiplier.reset();
      } else {
        c.ffn_dim_multiplier = as_double(key, v);
      }
    } else if (key == "max_seq_len") {
      c.max_seq_len = as_int(key, v);
    } else if (key == "norm_eps") {
      c.norm_eps = as_double(key, v);
    } else if (key == "rope_theta") {
      c.rope_theta = as_double(key, v);
    } else if (key == "rope_scaling") {
      if (v.is_null()) {
        c.rope_scaling.reset();
        continue;
      }
      TORCH_CHECK(v.is_object(), "DecoderConfig JSON: 'rope_scaling' must be null or an object");
      Llama3RopeScaling r;
      for (const auto& [k, x] : v.items()) {
        const std::string name = "rope_scaling." + k;
        if (k == "factor") {
          r.factor = as_double(name, x);
        } else if (k == "low_freq_factor") {
          r.low_freq_factor = as_double(name, x);
        } else if (k == "high_freq_factor") {
          r.high_freq_factor = as_double(name, x);
        } else if (k == "original_max_position_embeddings") {
          r.original_max_position_embeddings = as_int(name, x);
        } else {
          TORCH_CHECK(false, "DecoderConfig JSON: unknown key '", name, "'");
        }
      }
      c.rope_scaling = r;
    } else if (key == "head_size") {
      c.head_size = v.is_null() ? 0 : as_int(key, v);
    } else if (key == "qkv_bias" || key == "wo_bias" || key == "qk_norm") {
      TORCH_CHECK(v.is_boolean(), "DecoderConfig JSON: '", key, "' must be true or false");
      (key == "qkv_bias" ? c.qkv_bias : key == "wo_bias" ? c.wo_bias : c.qk_norm) = v.get<bool>();
    } else if (key == "sliding_window") {
      c.sliding_window = v.is_null() ? 0 : as_int(key, v);
    } else if (key == "sliding_layers") {
      TORCH_CHECK(v.is_array(),
                  "DecoderConfig JSON: 'sliding_layers' must be an array of booleans");
      c.sliding_layers.clear();
      for (const auto& b : v) {
        TORCH_CHECK(b.is_boolean(), "DecoderConfig JSON: 'sliding_layers' must hold booleans");
        c.sliding_layers.push_back(b.get<bool>());
      }
    } else if (key == "tie_embeddings" || key == "post_norms" || key == "scale_embeddings") {
      TORCH_CHECK(v.is_boolean(), "DecoderConfig JSON: '", key, "' must be true or false");
      (key == "tie_embeddings" ? c.tie_embeddings
       : key == "post_norms"   ? c.post_norms
                               : c.scale_embeddings) = v.get<bool>();
    } else if (key == "rope_local_theta") {
      c.rope_local_theta = v.is_null() ? 0 : as_double(key, v);
    } else if (key == "query_pre_attn_scalar") {
      c.query_pre_attn_scalar = v.is_null() ? 0 : as_double(key, v);
    } else if (key == "final_logit_softcap") {
      c.final_logit_softcap = v.is_null() ? 0 : as_double(key, v);
    } else if (key == "dropout") {
      c.dropout = v.is_null() ? 0 : as_double(key, v);
    } else if (key == "norm_weight_offset") {
      c.norm_weight_offset = as_double(key, v);
    } else if (key == "activation") {
      TORCH_CHECK(v.is_string(), "DecoderConfig JSON: 'activation' must be a string");
      c.activation = v.get<std::string>();
    } else if (key == "moe") {
      if (v.is_null())
        c.moe.reset();
      else
        c.moe = moe_from_json(v);
    } else if (key == "norm_scale_in_float32") {
      c.norm_scale_in_float32 = as_bool(key, v);
    } else if (key == "attention_sinks") {
      c.attention_sinks = as_bool(key, v);
    } else if (key == "rope_yarn") {
      if (v.is_null())
        c.rope_yarn.reset();
      else
        c.rope_yarn = yarn_from_json(v);
    } else {
      TORCH_CHECK(false, "DecoderConfig JSON: unknown key '", key, "'");
    }
  }
  c.validate();
  return c;
}

std::string DecoderConfig::to_json() const {
  nlohmann::ordered_json j;
  j["vocab_size"] = vocab_size;
  j["dim"] = dim;
  j["n_layers"] = n_layers;
  j["n_heads"] = n_heads;
  j["n_kv_heads"] = kv_heads();
  j["ffn_hidden_dim"] = hidden_dim();
  j["multiple_of"] = multiple_of;
  j["ffn_dim_multiplier"] = ffn_dim_multiplier ? json(*ffn_dim_multiplier) : json(nullptr);
  j["max_seq_len"] = max_seq_len;
  j["norm_eps"] = norm_eps;
  j["rope_theta"] = rope_theta;
  if (rope_scaling) {
    j["rope_scaling"] = {
        {"factor", rope_scaling->factor},
        {"low_freq_factor", rope_scaling->low_freq_factor},
        {"high_freq_factor", rope_scaling->high_freq_factor},
        {"original_max_position_embeddings", rope_scaling->original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_embeddings"] = tie_embeddings;
  j["head_size"] = head_dim();
  j["qkv_bias"] = qkv_bias;
  j["wo_bias"] = wo_bias;
  j["qk_norm"] = qk_norm;
  j["sliding_window"] = sliding_window;
  j["sliding_layers"] = sliding_layers;
  j["rope_local_theta"] = rope_local_theta;
  j["query_pre_attn_scalar"] = query_pre_attn_scalar;
  j["norm_weight_offset"] = norm_weight_offset;
  j["post_norms"] = post_norms;
  j["scale_embeddings"] = scale_embeddings;
  j["activation"] = activation;
  j["final_logit_softcap"] = final_logit_softcap;
  j["dropout"] = dropout;
  if (moe) {
    const MoeOptions& o = moe->options;
    j["moe"] = {{"num_experts", o.num_experts},
                {"top_k", o.top_k},
                {"expert_hidden_dim", moe->expert_hidden_dim},
                {"router", router_name(o.scoring)},
                {"renormalize", o.renormalize},
                {"float32_weights", o.float32_weights},
                {"router_bias", o.router_bias},
                {"expert_bias", o.expert_bias},
                {"activation", expert_activation_name(o.activation)},
                {"swiglu_alpha", o.swiglu_alpha},
                {"swiglu_limit", o.swiglu_limit},
                {"sparse_layers", moe->sparse_layers},
                {"router_aux_loss_coef", moe->router_aux_loss_coef}};
  } else {
    j["moe"] = nullptr;
  }
  j["norm_scale_in_float32"] = norm_scale_in_float32;
  j["attention_sinks"] = attention_sinks;
  if (rope_yarn) {
    const YarnRopeScaling& y = *rope_yarn;
    j["rope_yarn"] = {
        {"factor", y.factor},
        {"beta_fast", y.beta_fast},
        {"beta_slow", y.beta_slow},
        {"original_max_position_embeddings", y.original_max_position_embeddings},
        {"truncate", y.truncate},
        {"attention_factor", y.attention_factor ? json(*y.attention_factor) : json(nullptr)},
        {"mscale", y.mscale},
        {"mscale_all_dim", y.mscale_all_dim}};
  } else {
    j["rope_yarn"] = nullptr;
  }
  return j.dump();
}

}  // namespace dtensor::models
