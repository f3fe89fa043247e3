// The decoder (torchtitan's llama3 and its families), whole or a pipeline stage of it, its
// deterministic initialisation and the loss.
#include "dtensor/models/transformer.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "block_math.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/cp/context_parallel.h"
#include "dtensor/models/residual_dropout.h"
#include "dtensor/pp/pipeline.h"
#include "dtensor/tp/loss_parallel.h"
#include "dtensor/util/hash.h"
#include "meta_construction.h"
#include "parameter_schema.h"

namespace dtensor::models {

namespace {

// A q/k norm weight as attention uses it: replicated under TP, its local value enters with a
// Partial gradient (each rank's heads give part of it), summed by reduce_partial_grads.
at::Tensor norm_weight(const dtensor::nn::RMSNorm& norm) {
  if (norm.is_empty()) return {};
  const at::Tensor& w = norm->weight;
  if (!is_dtensor(w)) return w;
  return to_local(w, std::vector<Placement>{Partial()});
}

// Access to a module's parameter registry, to take a tied weight out of it.
struct ParameterRegistry : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& of(torch::nn::Module& m) {
    return m.*(&ParameterRegistry::parameters_);
  }
};

// FNV-1a: a hash that is the same in every build, so seeds do not depend on the library. Its
// basis is not FNV's standard one (a digit short of it), and stays so: every initial weight
// depends on it.
uint64_t stable_hash(uint64_t seed, const std::string& s) {
  return util::fnv1a(s, 1469598103934665603ULL ^ (seed * util::kSplitMix64Gamma));
}

// torch.nn.init.trunc_normal_ (absolute bounds a, b), drawn in float64 on the CPU.
at::Tensor trunc_normal(at::IntArrayRef shape, double std, double a, double b, at::Generator gen) {
  auto cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
  const double lo = cdf(a / std), hi = cdf(b / std);
  auto t = at::empty(shape, at::kDouble);
  t.uniform_(2 * lo - 1, 2 * hi - 1, gen);
  t.erfinv_().mul_(std * std::sqrt(2.0));
  return t.clamp_(a, b);
}

// Llama 3.1's frequency scaling: long wavelengths slowed by `factor`, short ones kept, the
// band between blended linearly in (original context / wavelength).
at::Tensor llama3_scaled_frequencies(const at::Tensor& freqs, const Llama3RopeScaling& s) {
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  const double low_wavelen = old_len / s.low_freq_factor;
  const double high_wavelen = old_len / s.high_freq_factor;
  const auto wavelen = (2 * M_PI) / freqs;
  const auto scaled = at::where(wavelen > low_wavelen, freqs / s.factor, freqs);
  const auto smooth =
      (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  const auto blended = (1 - smooth) * scaled / s.factor + smooth * scaled;
  const auto medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, blended, scaled);
}

// The initial value of a parameter of `shape` drawn as `init` says (block `layer`'s).
at::Tensor initial_value(detail::Init init, at::IntArrayRef shape, int64_t layer,
                         const DecoderConfig& config, at::Generator gen) {
  switch (init) {
    case detail::Init::kEmbedding:
      return at::empty(shape, at::kDouble).normal_(0.0, 1.0, gen);
    case detail::Init::kProjection:
      return trunc_normal(shape, 0.02, -2.0, 2.0, gen);
    case detail::Init::kDepthScaled:  // torchtitan's depth init: output paths shrink with depth
      return trunc_normal(shape, 0.02 / std::sqrt(2.0 * static_cast<double>(layer + 1)), -2.0, 2.0,
                          gen);
    case detail::Init::kHead: {
      const double std = 1.0 / std::sqrt(static_cast<double>(config.dim));
      return trunc_normal(shape, std, -3 * std, 3 * std, gen);
    }
    case detail::Init::kNormScale:  // where the scale is one (offset + weight, nn::RMSNorm)
      return at::full(shape, 1.0 - config.norm_weight_offset, at::kDouble);
    case detail::Init::kZeros:
      return at::zeros(shape, at::kDouble);
  }
  TORCH_CHECK(false, "Transformer::init_weights: unknown initialisation");
}

// Context parallelism's rotary rows: for this rank's `batch` x `slots` of the scope's layout,
// the rows of `table` at their positions within their documents, (B, n, head_dim / 2, 2).
at::Tensor context_rope(const at::Tensor& table, const cp::ContextParallel& context, int64_t batch,
                        int64_t slots, const at::TensorOptions& options) {
  const cp::ContextLayout& layout = context.layout;
  TORCH_CHECK(batch == layout.batch() && slots == layout.local_len(),
              "Transformer under context parallelism (cp=", layout.cp_size(),
              "): expected this rank's slots of the layout, (", layout.batch(), ", ",
              layout.local_len(), ") tokens (layout.shard), got (", batch, ", ", slots, ")");
  const at::Tensor positions = context.local_positions();
  const int64_t longest = positions.numel() > 0 ? positions.max().item<int64_t>() + 1 : 0;
  TORCH_CHECK(
      longest <= table.size(0), "sequence length ", longest,
      " (a document's positions under context parallelism) exceeds max_seq_len=", table.size(0));
  return table.index_select(0, positions.flatten())
      .view({positions.size(0), positions.size(1), table.size(1), 2})
      .to(options);
}

}  // namespace

// ---- modules ----

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t hidden_dim, std::string activation_)
    : activation(std::move(activation_)) {
  w1 = register_module("w1",
                       dtensor::nn::Linear(torch::nn::LinearOptions(dim, hidden_dim).bias(false)));
  w2 = register_module("w2",
                       dtensor::nn::Linear(torch::nn::LinearOptions(hidden_dim, dim).bias(false)));
  w3 = register_module("w3",
                       dtensor::nn::Linear(torch::nn::LinearOptions(dim, hidden_dim).bias(false)));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) {
  return call_forward(
      [this](const at::Tensor& x) {
        return w2(detail::gated_activation(w1(x), w3(x), activation));
      },
      x);
}

AttentionImpl::AttentionImpl(const DecoderConfig& config, int64_t layer_id)
    : n_heads(config.n_heads),
      n_kv_heads(config.kv_heads()),
      head_dim(config.head_dim()),
      window(config.window(layer_id)),
      norm_eps(config.norm_eps),
      norm_offset(config.norm_weight_offset),
      // 0 lets SDPA derive head_dim's scale itself (Llama's numbers as they were).
      scale(config.query_pre_attn_scalar > 0 ? config.attention_scale() : 0) {
  auto linear = [](int64_t in, int64_t out, bool bias) {
    return dtensor::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  };
  wq = register_module("wq", linear(config.dim, n_heads * head_dim, config.qkv_bias));
  wk = register_module("wk", linear(config.dim, n_kv_heads * head_dim, config.qkv_bias));
  wv = register_module("wv", linear(config.dim, n_kv_heads * head_dim, config.qkv_bias));
  wo = register_module("wo", linear(n_heads * head_dim, config.dim, config.wo_bias));
  if (config.attention_sinks) sinks = register_parameter("sinks", at::zeros({n_heads}));
  if (config.qk_norm) {
    dtensor::nn::RMSNormOptions options(head_dim);
    options.eps = config.norm_eps;
    options.weight_offset = config.norm_weight_offset;
    q_norm = register_module("q_norm", dtensor::nn::RMSNorm(options));
    k_norm = register_module("k_norm", dtensor::nn::RMSNorm(options));
  }
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& rope) {
  return call_forward(
      [this](const at::Tensor& x, const at::Tensor& rope) {
        // In this order: autograd then sums the input's gradient as (v + k) + q, which the
        // overlapped plan reproduces (argument evaluation order would be unspecified).
        const at::Tensor q = wq(x), k = wk(x), v = wv(x);
        return wo(attend(q, k, v, rope));
      },
      x, rope);
}

at::Tensor AttentionImpl::attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& rope) {
  // (S, ..) one table for every row; (B, S, ..) context parallelism's rows of positions.
  const at::Tensor r = rope.dim() == 3 ? rope.unsqueeze(0) : rope;
  const at::Tensor xq = detail::heads(q, head_dim, norm_weight(q_norm), norm_eps, r, norm_offset);
  const at::Tensor xk = detail::heads(k, head_dim, norm_weight(k_norm), norm_eps, r, norm_offset);
  const at::Tensor xv = detail::heads(v, head_dim, {}, norm_eps, {});
  if (const cp::ContextParallel* context = cp::ContextParallelScope::current()) {
    TORCH_CHECK(!sinks.defined(),
                "attention sinks are not supported under context parallelism (cp=",
                context->layout.cp_size(), "): the blocks' merge has no sink logit");
    return cp::context_attention(xq, xk, xv, context->layout, context->group,
                                 {.window = window, .scale = scale, .rotate = context->rotate});
  }
  const at::Tensor mask =
      detail::attention_mask(0, xq.size(1), /*padding=*/{}, window, xq.device());
  // Sinks are sharded with the heads: this rank's heads' own.
  const at::Tensor local_sinks = sinks.defined() && is_dtensor(sinks) ? to_local(sinks) : sinks;
  return detail::attend(xq, xk, xv, mask, /*cache=*/nullptr, scale, local_sinks);
}

void AttentionImpl::on_parameter_replaced(const std::string& name, const at::Tensor& value) {
  if (name == "sinks") sinks = value;
}

TransformerBlockImpl::TransformerBlockImpl(int64_t layer_id_, const DecoderConfig& config)
    : layer_id(layer_id_), dropout(config.dropout) {
  dtensor::nn::RMSNormOptions norm_options(config.dim);
  norm_options.eps = config.norm_eps;
  norm_options.weight_offset = config.norm_weight_offset;
  norm_options.scale_in_float32 = config.norm_scale_in_float32;
  attention_norm = register_module("attention_norm", dtensor::nn::RMSNorm(norm_options));
  attention = register_module("attention", Attention(config, layer_id));
  if (config.post_norms)
    attention_post_norm =
        register_module("attention_post_norm", dtensor::nn::RMSNorm(norm_options));
  ffn_norm = register_module("ffn_norm", dtensor::nn::RMSNorm(norm_options));
  if (config.sparse(layer_id))
    moe =
        register_module("moe", MoE(config.dim, config.moe->expert_hidden_dim, config.moe->options));
  else
    feed_forward = register_module("feed_forward",
                                   FeedForward(config.dim, config.hidden_dim(), config.activation));
  if (config.post_norms)
    ffn_post_norm = register_module("ffn_post_norm", dtensor::nn::RMSNorm(norm_options));
}

at::Tensor TransformerBlockImpl::forward(const at::Tensor& x, const at::Tensor& rope) {
  return call_forward(
      [this](const at::Tensor& x, const at::Tensor& rope) {
        const bool drop = is_training() && dropout > 0;
        at::Tensor a = attention(attention_norm(x), rope);
        if (!attention_post_norm.is_empty()) a = attention_post_norm(a);
        if (drop) a = residual_dropout(a, dropout, layer_id, 0);
        const at::Tensor h = x + a;
        const at::Tensor n = ffn_norm(h);
        at::Tensor f = moe.is_empty() ? feed_forward(n) : moe(n);
        if (!ffn_post_norm.is_empty()) f = ffn_post_norm(f);
        if (drop) f = residual_dropout(f, dropout, layer_id, 1);
        return h + f;
      },
      x, rope);
}

TransformerImpl::TransformerImpl(DecoderConfig config)
    : config_(std::move(config)), end_layer_(config_.n_layers) {
  config_.validate();
  tok_embeddings =
      register_module("tok_embeddings", dtensor::nn::Embedding(config_.vocab_size, config_.dim));
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> blocks;
  for (int64_t i = 0; i < config_.n_layers; ++i)
    blocks.emplace_back(std::to_string(i), TransformerBlock(i, config_).ptr());
  layers = register_module("layers", torch::nn::ModuleDict(blocks));
  dtensor::nn::RMSNormOptions norm_options(config_.dim);
  norm_options.eps = config_.norm_eps;
  norm_options.weight_offset = config_.norm_weight_offset;
  norm_options.scale_in_float32 = config_.norm_scale_in_float32;
  norm = register_module("norm", dtensor::nn::RMSNorm(norm_options));
  output = register_module(
      "output",
      dtensor::nn::Linear(torch::nn::LinearOptions(config_.dim, config_.vocab_size).bias(false)));
  if (config_.tie_embeddings) tie_output_to_embedding();

  // Built on the meta device (empty_transformer): parameters without values, but the rotary
  // table is no parameter and is needed as it is.
  const bool meta = detail::MetaConstructionGuard::active();
  detail::MetaConstructionGuard::Suspend ordinary_tensors;
  // Rotation angle of position p for pair i: p * theta^(-2i / head_dim).
  const int64_t hd = config_.head_dim();
  auto table = [&](double theta) {
    auto freqs = at::pow(theta, -at::arange(0, hd, 2, at::kDouble).div(static_cast<double>(hd)));
    if (config_.rope_scaling) freqs = llama3_scaled_frequencies(freqs, *config_.rope_scaling);
    if (config_.rope_yarn) freqs = yarn_inverse_frequencies(hd, theta, *config_.rope_yarn);
    auto angles = at::outer(at::arange(config_.max_seq_len, at::kDouble), freqs);
    // YaRN scales cos and sin alike (transformers' attention_scaling).
    const double factor = config_.rope_yarn ? yarn_attention_factor(*config_.rope_yarn) : 1.0;
    return at::stack({angles.cos() * factor, angles.sin() * factor}, -1);
  };
  rope_table_ = table(config_.rope_theta);
  if (config_.rope_local_theta > 0) local_rope_table_ = table(config_.rope_local_theta);
  if (!meta) init_weights(0);
}

TransformerImpl::TransformerImpl(TransformerImpl& whole, int64_t stage, int64_t num_stages)
    : config_(whole.config()),
      stage_(stage),
      num_stages_(num_stages),
      pipeline_stage_(true),
      rope_table_(whole.rope_table_),
      local_rope_table_(whole.local_rope_table_) {
  for (const auto& p : whole.parameters())
    TORCH_CHECK(!is_dtensor(p),
                "split_transformer_stage: split the model before apply_tensor_parallel (then "
                "parallelize each stage with apply_tensor_parallel(stage, mesh))");
  TORCH_CHECK(!whole.is_pipeline_stage(),
              "split_transformer_stage: the model is a pipeline stage "
              "already; split the whole model");
  std::tie(first_layer_, end_layer_) = pp::stage_layer_range(config_.n_layers, stage, num_stages);
  const bool first = stage == 0, last = stage == num_stages - 1;
  if (first) tok_embeddings = register_module("tok_embeddings", whole.tok_embeddings);
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> blocks;
  for (int64_t i = first_layer_; i < end_layer_; ++i)
    blocks.emplace_back(std::to_string(i), whole.layers[std::to_string(i)]);
  layers = register_module("layers", torch::nn::ModuleDict(blocks));
  if (!last) return;
  norm = register_module("norm", whole.norm);
  if (!config_.tie_embeddings || first) {
    output = register_module("output", whole.output);
    return;
  }
  // The embedding lives on the first stage: this stage gets a copy of its own, kept equal by
  // summing the two stages' gradients (make_pipeline_stage ties them).
  const at::Tensor& embedding = whole.tok_embeddings->weight;
  const auto make_output = [this] {
    output =
        dtensor::nn::Linear(torch::nn::LinearOptions(config_.dim, config_.vocab_size).bias(false));
  };
  if (embedding.is_meta()) {  // shapes only, like the whole: init_stage_weights fills it
    detail::MetaConstructionGuard meta;
    make_output();
  } else {
    // Linear's own initialisation draws from the default generator: restore it, so that this
    // rank's later random numbers (a batch drawn alike on every rank) stay the others'.
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    const at::Tensor state = gen.get_state();
    make_output();
    gen.set_state(state);
  }
  output->to(embedding.scalar_type());
  if (!embedding.is_meta()) {
    at::NoGradGuard no_grad;
    output->weight.copy_(embedding);
  }
  output = register_module("output", output);
  tied_across_stages_ = true;
}

std::vector<at::Tensor> TransformerImpl::router_logits() const {
  std::vector<at::Tensor> out;
  for (TransformerBlockImpl* block : blocks())
    if (!block->moe.is_empty() && block->moe->last_router_logits().defined())
      out.push_back(block->moe->last_router_logits());
  return out;
}

at::Tensor TransformerImpl::aux_loss(const std::optional<DeviceMesh>& data_parallel) const {
  const std::vector<at::Tensor> logits = router_logits();
  if (logits.empty()) return {};
  const MoeOptions& o = config_.moe->options;
  at::Tensor aux = load_balancing_loss(logits, o.num_experts, o.top_k, data_parallel);
  last_aux_loss_ = aux.detach();
  return aux;
}

at::Tensor TransformerImpl::tokens_per_expert() const {
  at::Tensor sum;
  for (TransformerBlockImpl* block : blocks()) {
    if (block->moe.is_empty() || !block->moe->last_tokens_per_expert().defined()) continue;
    const at::Tensor& t = block->moe->last_tokens_per_expert();
    sum = sum.defined() ? sum + t : t.clone();
  }
  return sum;
}

TransformerBlockImpl& TransformerImpl::block(int64_t layer) const {
  const std::string key = std::to_string(layer);
  TORCH_CHECK(layers->contains(key), "Transformer: block ", layer, " is not in this ",
              pipeline_stage_ ? "pipeline stage" : "model");
  return *(*layers)[key]->as<TransformerBlockImpl>();
}

std::vector<TransformerBlockImpl*> TransformerImpl::blocks() const {
  std::vector<TransformerBlockImpl*> out;
  for (const auto& item : *layers) out.push_back(item.value()->as<TransformerBlockImpl>());
  return out;
}

void TransformerImpl::tie_output_to_embedding() {
  // A pipeline stage holds one end at most (the last stage's head is a copy of its own).
  if (tok_embeddings.is_empty() || output.is_empty()) return;
  // The output head uses the embedding's weight but does not register it: parameters() then
  // lists it once (as Python's dedup does), so an optimizer steps it once.
  auto& registry = ParameterRegistry::of(*output);
  if (registry.contains("weight")) registry.erase("weight");
  output->weight = tok_embeddings->weight;
}

at::Tensor TransformerImpl::rope(int64_t seqlen, const at::TensorOptions& options,
                                 int64_t layer) const {
  TORCH_CHECK(seqlen <= config_.max_seq_len, "sequence length ", seqlen,
              " exceeds max_seq_len=", config_.max_seq_len);
  const bool local = local_rope_table_.defined() && layer >= 0 && config_.window(layer) > 0;
  return (local ? local_rope_table_ : rope_table_).slice(0, 0, seqlen).to(options);
}

at::Tensor TransformerImpl::forward(const at::Tensor& input) {
  return call_forward(
      [this](const at::Tensor& input) {
        at::Tensor h = input;
        // FSDP swaps the embedding's weight for its gathered tensor around each forward (and TP
        // for its DTensor): a tied head computes with whatever the embedding holds now.
        if (config_.tie_embeddings) tie_output_to_embedding();
        if (!tok_embeddings.is_empty()) {
          TORCH_CHECK(input.dim() == 2, "Transformer", stage_label(),
                      ": tokens must be (batch, seqlen), got ", input.sizes());
          h = detail::scale_embeddings(tok_embeddings(input), config_.dim,
                                       config_.scale_embeddings);
        } else {
          TORCH_CHECK(input.dim() == 3 && input.size(2) == config_.dim, "Transformer",
                      stage_label(), ": expected hidden states (batch, seqlen, ", config_.dim,
                      "), got ", input.sizes());
        }
        // The whole sequence (tokens are whole on every rank; a stage's hidden states are whole,
        // as stages run without sequence parallelism).
        const at::Tensor& local = is_dtensor(h) ? local_tensor(h) : h;
        const int64_t seqlen = tok_embeddings.is_empty() ? local.size(1) : input.size(1);
        // The global table, and the sliding layers' own when their base differs.
        at::Tensor rope_table = rope(seqlen, local.options());
        at::Tensor local_table = local_rope_table_.defined()
                                     ? local_rope_table_.slice(0, 0, seqlen).to(local.options())
                                     : rope_table;
        if (const cp::ContextParallel* context = cp::ContextParallelScope::current()) {
          const int64_t rows = local.size(0);  // seqlen: this rank's slots of each row
          rope_table = context_rope(rope_table_, *context, rows, seqlen, local.options());
          local_table = local_rope_table_.defined() ? context_rope(local_rope_table_, *context,
                                                                   rows, seqlen, local.options())
                                                    : rope_table;
        }
        for (TransformerBlockImpl* block : blocks()) {
          const bool slides = config_.window(block->layer_id) > 0;
          h = block->forward(h, slides ? local_table : rope_table);
        }
        if (!norm.is_empty()) h = norm(h);
        if (output.is_empty()) return h;
        return detail::softcap(output(h), config_.final_logit_softcap);
      },
      input);
}

std::string TransformerImpl::stage_label() const {
  if (!pipeline_stage_) return "";
  return " (pipeline stage " + std::to_string(stage_) + " of " + std::to_string(num_stages_) + ")";
}

void TransformerImpl::init_weights(uint64_t seed) {
  at::NoGradGuard no_grad;
  const auto params = named_parameters(/*recurse=*/true);
  for (const detail::NamedRow& entry : detail::parameter_names(config_)) {
    const at::Tensor* found = params.find(entry.name);
    if (found == nullptr) continue;  // in another pipeline stage
    const at::Tensor& param = *found;
    // A parameter without memory belongs to another rank's pipeline stage (init_stage_weights).
    if ((is_dtensor(param) ? local_tensor(param) : param).is_meta()) continue;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(stable_hash(seed, entry.name));
    const at::Tensor full =
        initial_value(entry.row->init, param.sizes(), entry.layer, config_, gen);
    if (is_dtensor(param)) {
      // Keep this rank's chunk of the whole value: no communication.
      const auto& spec = spec_of(param);
      auto mine = local_tensor(
          distribute_tensor(full, spec.mesh(), spec.placements(), /*src_data_rank=*/std::nullopt));
      local_tensor(param).copy_(mine);
    } else {
      param.copy_(full);
    }
  }
}

// ---- loss ----

at::Tensor token_cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() == 3 && targets.dim() == 2 && logits.size(0) == targets.size(0) &&
                  logits.size(1) == targets.size(1),
              "token_cross_entropy: expected logits (B, S, V) and targets (B, S), got ",
              logits.sizes(), " and ", targets.sizes());
  if (!is_dtensor(logits)) return at::cross_entropy_loss(logits.flatten(0, 1), targets.flatten());
  return tp::vocab_parallel_cross_entropy(logits, targets);
}

at::Tensor context_parallel_loss(const at::Tensor& logits, const at::Tensor& targets, int64_t cp,
                                 int64_t tokens) {
  TORCH_CHECK(logits.dim() == 3 && targets.dim() == 2 && logits.size(0) == targets.size(0) &&
                  logits.size(1) == targets.size(1),
              "context_parallel_loss: expected logits (B, n, V) and targets (B, n), got ",
              logits.sizes(), " and ", targets.sizes());
  TORCH_CHECK(cp >= 1 && tokens >= 1, "context_parallel_loss: cp (", cp, ") and the batch's ",
              "real targets (", tokens, ") must be at least 1");
  const at::Tensor sum = is_dtensor(logits)
                             ? tp::vocab_parallel_cross_entropy(logits, targets, at::Reduction::Sum)
                             : at::cross_entropy_loss(logits.flatten(0, 1), targets.flatten(),
                                                      /*weight=*/{}, at::Reduction::Sum);
  return sum * (static_cast<double>(cp) / static_cast<double>(tokens));
}

at::Tensor training_loss(const TransformerImpl& model, const at::Tensor& logits,
                         const at::Tensor& targets,
                         const std::optional<DeviceMesh>& data_parallel) {
  at::Tensor loss = token_cross_entropy(logits, targets);
  const at::Tensor aux = model.aux_loss(data_parallel);
  if (!aux.defined()) return loss;
  return loss + aux.to(loss.scalar_type()) * model.config().moe->router_aux_loss_coef;
}

at::Tensor loss_and_backward(const at::Tensor& logits, const at::Tensor& targets) {
  auto loss = models::token_cross_entropy(logits, targets);
  loss.backward();
  return loss.detach();
}

}  // namespace dtensor::models
