// The Llama model (torchtitan's llama3), its deterministic initialisation and the loss.
#include "dtensor/models/transformer.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "block_math.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/models/residual_dropout.h"
#include "dtensor/tp/loss_parallel.h"
#include "dtensor/tp/overlap.h"
#include "dtensor/util/hash.h"
#include "meta_construction.h"

namespace dtensor::models {

namespace {

// Without overlap, autograd sums the input gradients of wq, wk and wv as (v + k) + q: the value
// path's backward finishes first (its nodes were created last), then the key's. The overlapped
// projections sum in the same order so that their results are bitwise the same.
const std::vector<int64_t> kQkvGradSumOrder{2, 1, 0};

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
        if (!overlap) return w2(detail::gated_activation(w1(x), w3(x), activation));
        const auto h =
            tp::all_gather_matmul(x, {w1->weight, w3->weight}, overlap->mesh, overlap->chunks);
        return tp::matmul_reduce_scatter(detail::gated_activation(h[0], h[1], activation),
                                         w2->weight, overlap->mesh, overlap->chunks);
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
        at::Tensor q, k, v;
        if (overlap) {
          const auto qkv = tp::all_gather_matmul(x, {wq->weight, wk->weight, wv->weight},
                                                 overlap->mesh, overlap->chunks, kQkvGradSumOrder);
          q = qkv[0], k = qkv[1], v = qkv[2];
        } else {
          q = wq(x), k = wk(x), v = wv(x);
        }
        const at::Tensor r = rope.unsqueeze(0);
        const at::Tensor xq =
            detail::heads(q, head_dim, norm_weight(q_norm), norm_eps, r, norm_offset);
        const at::Tensor xk =
            detail::heads(k, head_dim, norm_weight(k_norm), norm_eps, r, norm_offset);
        const at::Tensor xv = detail::heads(v, head_dim, {}, norm_eps, {});
        const at::Tensor mask =
            detail::attention_mask(0, xq.size(1), /*padding=*/{}, window, xq.device());
        const at::Tensor out = detail::attend(xq, xk, xv, mask, /*cache=*/nullptr, scale);
        if (overlap)
          return tp::matmul_reduce_scatter(out, wo->weight, overlap->mesh, overlap->chunks);
        return wo(out);
      },
      x, rope);
}

TransformerBlockImpl::TransformerBlockImpl(int64_t layer_id_, const DecoderConfig& config)
    : layer_id(layer_id_), dropout(config.dropout) {
  dtensor::nn::RMSNormOptions norm_options(config.dim);
  norm_options.eps = config.norm_eps;
  norm_options.weight_offset = config.norm_weight_offset;
  attention_norm = register_module("attention_norm", dtensor::nn::RMSNorm(norm_options));
  attention = register_module("attention", Attention(config, layer_id));
  if (config.post_norms)
    attention_post_norm =
        register_module("attention_post_norm", dtensor::nn::RMSNorm(norm_options));
  ffn_norm = register_module("ffn_norm", dtensor::nn::RMSNorm(norm_options));
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
        at::Tensor f = feed_forward(ffn_norm(h));
        if (!ffn_post_norm.is_empty()) f = ffn_post_norm(f);
        if (drop) f = residual_dropout(f, dropout, layer_id, 1);
        return h + f;
      },
      x, rope);
}

TransformerImpl::TransformerImpl(DecoderConfig config) : config_(std::move(config)) {
  config_.validate();
  tok_embeddings =
      register_module("tok_embeddings", dtensor::nn::Embedding(config_.vocab_size, config_.dim));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.n_layers; ++i) layers->push_back(TransformerBlock(i, config_));
  dtensor::nn::RMSNormOptions norm_options(config_.dim);
  norm_options.eps = config_.norm_eps;
  norm_options.weight_offset = config_.norm_weight_offset;
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
    auto angles = at::outer(at::arange(config_.max_seq_len, at::kDouble), freqs);
    return at::stack({angles.cos(), angles.sin()}, -1);
  };
  rope_table_ = table(config_.rope_theta);
  if (config_.rope_local_theta > 0) local_rope_table_ = table(config_.rope_local_theta);
  if (!meta) init_weights(0);
}

void TransformerImpl::tie_output_to_embedding() {
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

at::Tensor TransformerImpl::forward(const at::Tensor& tokens) {
  return call_forward(
      [this](const at::Tensor& tokens) {
        TORCH_CHECK(tokens.dim() == 2, "Transformer: tokens must be (batch, seqlen), got ",
                    tokens.sizes());
        const int64_t seqlen = tokens.size(1);
        // FSDP swaps the embedding's weight for its gathered tensor around each forward (and TP
        // for its DTensor): a tied head computes with whatever the embedding holds now.
        if (config_.tie_embeddings) tie_output_to_embedding();
        if (tp_state_ && tp_state_->sequence_parallel) {
          const int64_t tp = tp_state_->mesh.size();
          TORCH_CHECK(seqlen % tp == 0, "sequence length ", seqlen, " is not divisible by tp=", tp,
                      ": sequence parallelism keeps equal sequence shards as plain local "
                      "tensors; pad the batch to a multiple of ",
                      tp, " or apply_tensor_parallel with sequence_parallel=false");
          TORCH_CHECK(!is_training() || config_.dropout == 0,
                      "Transformer: residual dropout keys its masks by whole sequences, but "
                      "sequence parallelism gives each rank a slice of them; apply_tensor_parallel "
                      "with sequence_parallel=false, or set DecoderConfig::dropout to 0");
        }
        auto h =
            detail::scale_embeddings(tok_embeddings(tokens), config_.dim, config_.scale_embeddings);
        const at::Tensor& local = is_dtensor(h) ? local_tensor(h) : h;
        // The global table, and the sliding layers' own when their base differs.
        const at::Tensor rope_table = rope(seqlen, local.options());
        const at::Tensor local_table =
            local_rope_table_.defined() ? local_rope_table_.slice(0, 0, seqlen).to(local.options())
                                        : rope_table;
        for (int64_t i = 0; i < static_cast<int64_t>(layers->size()); ++i) {
          const bool slides = config_.window(i) > 0;
          h = layers[i]->as<TransformerBlock>()->forward(h, slides ? local_table : rope_table);
        }
        const double cap = config_.final_logit_softcap;
        if (tp_state_ && tp_state_->overlap_chunks)
          return detail::softcap(overlapped_head(norm(h)), cap);
        return detail::softcap(output(norm(h)), cap);
      },
      tokens);
}

// The output head with its input all-gather in pieces: the local matmul ColwiseParallel (or
// the tied head's input/output conversions) would run, so the logits are bitwise the same,
// vocab-sharded under loss parallel and gathered whole otherwise.
at::Tensor TransformerImpl::overlapped_head(const at::Tensor& x) {
  const TensorParallelState& tp = *tp_state_;
  const at::Tensor local =
      tp::all_gather_matmul(x, {output->weight}, tp.mesh, *tp.overlap_chunks)[0];
  const at::Tensor logits = from_local(local, tp.mesh, {Shard(local.dim() - 1)});
  if (tp.loss_parallel) return logits;
  return to_local(redistribute(logits, {Replicate()}));
}

void TransformerImpl::init_weights(uint64_t seed) {
  at::NoGradGuard no_grad;
  auto set = [&](const std::string& name, at::Tensor& param, auto draw) {
    // A parameter without memory belongs to another rank's pipeline stage (init_stage_weights).
    if ((is_dtensor(param) ? local_tensor(param) : param).is_meta()) return;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(stable_hash(seed, name));
    at::Tensor full = draw(param.sizes(), gen);
    if (is_dtensor(param)) {
      // Keep this rank's chunk of the whole value: no communication.
      const auto& spec = spec_of(param);
      auto mine = local_tensor(
          distribute_tensor(full, spec.mesh(), spec.placements(), /*src_data_rank=*/std::nullopt));
      local_tensor(param).copy_(mine);
    } else {
      param.copy_(full);
    }
  };
  auto normal = [](double std) {
    return [std](at::IntArrayRef shape, at::Generator gen) {
      return at::empty(shape, at::kDouble).normal_(0.0, std, gen);
    };
  };
  auto truncated = [](double std, double a = -2.0, double b = 2.0) {
    return [=](at::IntArrayRef shape, at::Generator gen) {
      return trunc_normal(shape, std, a, b, gen);
    };
  };
  // Norm weights start where their scale is one (offset + weight, dtensor::nn::RMSNorm).
  const double one = 1.0 - config_.norm_weight_offset;
  auto ones = [one](at::IntArrayRef shape, at::Generator) {
    return at::full(shape, one, at::kDouble);
  };

  set("tok_embeddings.weight", tok_embeddings->weight, normal(1.0));
  for (size_t i = 0; i < layers->size(); ++i) {
    auto block = layers[i]->as<TransformerBlock>();
    const std::string p = "layers." + std::to_string(i) + ".";
    // torchtitan's depth init: output projections shrink with depth.
    const double init_std = 0.02 / std::sqrt(2.0 * static_cast<double>(i + 1));
    set(p + "attention_norm.weight", block->attention_norm->weight, ones);
    set(p + "ffn_norm.weight", block->ffn_norm->weight, ones);
    if (!block->attention_post_norm.is_empty()) {
      set(p + "attention_post_norm.weight", block->attention_post_norm->weight, ones);
      set(p + "ffn_post_norm.weight", block->ffn_post_norm->weight, ones);
    }
    set(p + "attention.wq.weight", block->attention->wq->weight, truncated(0.02));
    set(p + "attention.wk.weight", block->attention->wk->weight, truncated(0.02));
    set(p + "attention.wv.weight", block->attention->wv->weight, truncated(0.02));
    set(p + "attention.wo.weight", block->attention->wo->weight, truncated(init_std));
    set(p + "feed_forward.w1.weight", block->feed_forward->w1->weight, truncated(0.02));
    set(p + "feed_forward.w2.weight", block->feed_forward->w2->weight, truncated(init_std));
    set(p + "feed_forward.w3.weight", block->feed_forward->w3->weight, truncated(init_std));
    auto& a = *block->attention;
    auto zeros = [](at::IntArrayRef shape, at::Generator) { return at::zeros(shape, at::kDouble); };
    std::pair<const char*, dtensor::nn::Linear> projections[] = {
        {"wq", a.wq}, {"wk", a.wk}, {"wv", a.wv}, {"wo", a.wo}};
    for (auto& [name, linear] : projections) {
      if (linear->bias.defined()) set(p + "attention." + name + ".bias", linear->bias, zeros);
    }
    if (!a.q_norm.is_empty()) {
      set(p + "attention.q_norm.weight", a.q_norm->weight, ones);
      set(p + "attention.k_norm.weight", a.k_norm->weight, ones);
    }
  }
  set("norm.weight", norm->weight, ones);
  if (!config_.tie_embeddings) {
    const double std = 1.0 / std::sqrt(static_cast<double>(config_.dim));
    set("output.weight", output->weight, truncated(std, -3 * std, 3 * std));
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

at::Tensor loss_and_backward(const at::Tensor& logits, const at::Tensor& targets) {
  auto loss = models::token_cross_entropy(logits, targets);
  loss.backward();
  return loss.detach();
}

}  // namespace dtensor::models
