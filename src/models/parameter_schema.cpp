// The decoder's parameter schema: see parameter_schema.h.
#include "parameter_schema.h"

#include <cstdlib>

namespace dtensor::models::detail {
namespace {

bool always(const DecoderConfig&, int64_t) { return true; }
bool untied(const DecoderConfig& c, int64_t) { return !c.tie_embeddings; }
bool qkv_bias(const DecoderConfig& c, int64_t) { return c.qkv_bias; }
bool wo_bias(const DecoderConfig& c, int64_t) { return c.wo_bias; }
bool qk_norm(const DecoderConfig& c, int64_t) { return c.qk_norm; }
bool post_norms(const DecoderConfig& c, int64_t) { return c.post_norms; }
bool sinks(const DecoderConfig& c, int64_t) { return c.attention_sinks; }
bool dense(const DecoderConfig& c, int64_t layer) { return !c.sparse(layer); }
bool sparse(const DecoderConfig& c, int64_t layer) { return c.sparse(layer); }
bool router_bias(const DecoderConfig& c, int64_t layer) {
  return c.sparse(layer) && c.moe->options.router_bias;
}
bool expert_bias(const DecoderConfig& c, int64_t layer) {
  return c.sparse(layer) && c.moe->options.expert_bias;
}

}  // namespace

const std::vector<ParameterRow>& model_parameter_rows() {
  using I = Init;
  using T = TpPlacement;
  using P = PlanStyle;
  using R = Role;
  static const std::vector<ParameterRow> rows{
      // name, HF name, HF with post norms, present, rotary rows, init, TP placement, plan, role
      {"tok_embeddings.weight", "model.embed_tokens.weight", nullptr, always, false, I::kEmbedding,
       T::kRows, P::kEmbedding, R::kEmbedding},
      {"norm.weight", "model.norm.weight", nullptr, always, false, I::kNormScale, T::kReplicated,
       P::kNorm, R::kFinalNorm},
      // Tied: the head computes with the embedding's weight and registers none (the plan still
      // converts its input and output).
      {"output.weight", "lm_head.weight", nullptr, untied, false, I::kHead, T::kRows, P::kHead,
       R::kOutput},
  };
  return rows;
}

const std::vector<ParameterRow>& block_parameter_rows() {
  using I = Init;
  using T = TpPlacement;
  using P = PlanStyle;
  using R = Role;
  static const std::vector<ParameterRow> rows{
      // name, HF name, HF with post norms, present, rotary rows, init, TP placement, plan, role
      {"attention_norm.weight", "input_layernorm.weight", nullptr, always, false, I::kNormScale,
       T::kReplicated, P::kNorm, R::kAttentionNorm},
      // A parameter of the attention module itself: listed before its projections'.
      {"attention.sinks", "self_attn.sinks", nullptr, sinks, false, I::kZeros, T::kRows,
       P::kHeadParameter, R::kSinks},
      {"attention.wq.weight", "self_attn.q_proj.weight", nullptr, always, true, I::kProjection,
       T::kRows, P::kColwise, R::kWq},
      {"attention.wq.bias", "self_attn.q_proj.bias", nullptr, qkv_bias, true, I::kZeros, T::kRows,
       P::kNone, R::kBq},
      {"attention.wk.weight", "self_attn.k_proj.weight", nullptr, always, true, I::kProjection,
       T::kKvRows, P::kKvColwise, R::kWk},
      {"attention.wk.bias", "self_attn.k_proj.bias", nullptr, qkv_bias, true, I::kZeros, T::kKvRows,
       P::kNone, R::kBk},
      {"attention.wv.weight", "self_attn.v_proj.weight", nullptr, always, false, I::kProjection,
       T::kKvRows, P::kKvColwise, R::kWv},
      {"attention.wv.bias", "self_attn.v_proj.bias", nullptr, qkv_bias, false, I::kZeros,
       T::kKvRows, P::kNone, R::kBv},
      {"attention.wo.weight", "self_attn.o_proj.weight", nullptr, always, false, I::kDepthScaled,
       T::kColumns, P::kRowwise, R::kWo},
      {"attention.wo.bias", "self_attn.o_proj.bias", nullptr, wo_bias, false, I::kZeros,
       T::kReplicated, P::kNone, R::kBo},
      {"attention.q_norm.weight", "self_attn.q_norm.weight", nullptr, qk_norm, true, I::kNormScale,
       T::kReplicated, P::kHeadNorm, R::kQNorm},
      {"attention.k_norm.weight", "self_attn.k_norm.weight", nullptr, qk_norm, true, I::kNormScale,
       T::kReplicated, P::kHeadNorm, R::kKNorm},
      // With post norms (Gemma) HF's post_attention_layernorm is the norm after attention, and
      // the one before the feed-forward is pre_feedforward_layernorm.
      {"attention_post_norm.weight", "post_attention_layernorm.weight", nullptr, post_norms, false,
       I::kNormScale, T::kReplicated, P::kPostNorm, R::kAttentionPostNorm},
      {"ffn_norm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
       always, false, I::kNormScale, T::kReplicated, P::kNorm, R::kFfnNorm},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight", nullptr, dense, false, I::kProjection,
       T::kRows, P::kColwise, R::kW1},
      {"feed_forward.w2.weight", "mlp.down_proj.weight", nullptr, dense, false, I::kDepthScaled,
       T::kColumns, P::kRowwise, R::kW2},
      {"feed_forward.w3.weight", "mlp.up_proj.weight", nullptr, dense, false, I::kDepthScaled,
       T::kRows, P::kColwise, R::kW3},
      // A sparse layer's mixture of experts (the "moe" sublayer's style splits the experts and
      // converts its input and output; moe.h).
      {"moe.router.weight", "weight", nullptr, sparse, false, I::kProjection, T::kReplicated,
       P::kNone, R::kRouter},
      {"moe.router.bias", "bias", nullptr, router_bias, false, I::kZeros, T::kReplicated, P::kNone,
       R::kRouterBias},
      {"moe.experts.w1", nullptr, nullptr, sparse, false, I::kProjection, T::kExpertHidden,
       P::kNone, R::kExpertW1},
      {"moe.experts.w2", nullptr, nullptr, sparse, false, I::kDepthScaled, T::kExpertDown, P::kNone,
       R::kExpertW2},
      {"moe.experts.w3", nullptr, nullptr, sparse, false, I::kDepthScaled, T::kExpertHidden,
       P::kNone, R::kExpertW3},
      {"moe.experts.b1", nullptr, nullptr, expert_bias, false, I::kZeros, T::kExpertHidden,
       P::kNone, R::kExpertB1},
      {"moe.experts.b2", nullptr, nullptr, expert_bias, false, I::kZeros, T::kReplicated, P::kNone,
       R::kExpertB2},
      {"moe.experts.b3", nullptr, nullptr, expert_bias, false, I::kZeros, T::kExpertHidden,
       P::kNone, R::kExpertB3},
      {"ffn_post_norm.weight", "post_feedforward_layernorm.weight", nullptr, post_norms, false,
       I::kNormScale, T::kReplicated, P::kPostNorm, R::kFfnPostNorm},
  };
  return rows;
}

const std::vector<Sublayer>& block_sublayers() {
  static const std::vector<Sublayer> sublayers{{"attention", 2}, {"feed_forward", 1}, {"moe", 1}};
  return sublayers;
}

std::optional<FoundRow> find_parameter_row(const std::string& name) {
  for (const ParameterRow& row : model_parameter_rows())
    if (name == row.name) return FoundRow{&row, -1};
  const std::string layers = "layers.";
  if (name.rfind(layers, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', layers.size());
  if (dot == std::string::npos) return std::nullopt;
  const std::string index = name.substr(layers.size(), dot - layers.size());
  char* end = nullptr;
  const long long layer = std::strtoll(index.c_str(), &end, 10);
  if (index.empty() || *end != '\0' || layer < 0) return std::nullopt;
  const std::string rest = name.substr(dot + 1);
  for (const ParameterRow& row : block_parameter_rows())
    if (rest == row.name) return FoundRow{&row, static_cast<int64_t>(layer)};
  return std::nullopt;
}

std::vector<NamedRow> parameter_names(const DecoderConfig& config) {
  std::vector<NamedRow> out;
  const auto& top = model_parameter_rows();
  // The embedding comes before the blocks, the final norm and head after them.
  auto add_top = [&](bool embedding) {
    for (const ParameterRow& row : top)
      if ((row.role == Role::kEmbedding) == embedding && row.present(config, -1))
        out.push_back({row.name, &row, -1});
  };
  add_top(true);
  for (int64_t l = 0; l < config.n_layers; ++l)
    for (const ParameterRow& row : block_parameter_rows())
      if (row.present(config, l))
        out.push_back({"layers." + std::to_string(l) + "." + row.name, &row, l});
  add_top(false);
  return out;
}

}  // namespace dtensor::models::detail
