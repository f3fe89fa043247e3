// Cached inference for the decoder on local shards (CachedDecoder), sampling, and generate().
#include "dtensor/models/generate.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <string>

#include "block_math.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/core/shard_math.h"
#include "dtensor/nn/layers.h"
#include "dtensor/ops/layout_invariant.h"
#include "parameter_schema.h"
#include "tp_layout.h"
#include "dtensor/util/hash.h"

namespace dtensor::models {

namespace {

// This rank's part of a parameter, after checking that the plan placed it as its schema row says
// on `tp` ranks (`shard_dim` nullopt: replicated or plain).
at::Tensor local_part(const at::Tensor& param, std::optional<int64_t> shard_dim, int64_t tp,
                      const std::string& name) {
  if (!is_dtensor(param)) return param.detach();
  if (tp == 1) return local_tensor(param).detach();  // one rank holds everything
  const auto& ps = placements(param);
  const bool ok = ps.size() == 1 && (shard_dim ? ps[0].is_shard(*shard_dim) : ps[0].is_replicate());
  TORCH_CHECK(ok, "generate: parameter '", name, "' has placement ", ps[0].str(), ", expected ",
              shard_dim ? "Shard(" + std::to_string(*shard_dim) + ")" : std::string("Replicate()"),
              " as apply_tensor_parallel places it; parallelize the model with "
              "apply_tensor_parallel");
  return local_tensor(param).detach();
}

uint64_t mix(uint64_t a, uint64_t b) {
  // splitmix64 of the pair: distinct (seed, step) pairs give unrelated generator seeds.
  return util::splitmix64_mix(a * util::kSplitMix64Gamma + b + 0x632BE59BD9B4E019ULL);
}

}  // namespace

// ---- CachedDecoder ----

CachedDecoder::CachedDecoder(const TransformerImpl& model) : config_(model.config()) {
  const DecoderConfig& c = config_;
  TORCH_CHECK(!model.is_pipeline_stage(), "CachedDecoder: takes a whole model, not pipeline stage ",
              model.stage_index());
  const detail::TpLayout layout = detail::tp_layout_of(model);
  mesh_ = layout.mesh;
  tp_ = layout.tp;
  rank_ = layout.rank;
  const int64_t hd = c.head_dim();
  // This rank's part of parameter `name` laid out as its row says.
  auto part = [&](const std::string& name, const at::Tensor& param,
                  detail::TpPlacement placement) -> at::Tensor {
    switch (placement) {
      case detail::TpPlacement::kRows:
        return local_part(param, 0, tp_, name);
      case detail::TpPlacement::kColumns:
      case detail::TpPlacement::kExpertHidden:
        return local_part(param, 1, tp_, name);
      case detail::TpPlacement::kExpertDown:
        return local_part(param, 2, tp_, name);
      case detail::TpPlacement::kReplicated:
        return local_part(param, std::nullopt, tp_, name);
      case detail::TpPlacement::kKvRows: {
        if (layout.kv_sharded) return local_part(param, 0, tp_, name);
        // Replicated projection: keep the rows of the heads this rank's query heads use.
        const at::Tensor whole = local_part(param, std::nullopt, tp_, name);
        return whole.unflatten(0, {c.kv_heads(), hd})
            .index_select(0, layout.kv_heads.to(whole.device()))
            .flatten(0, 1);
      }
    }
    TORCH_CHECK(false, "CachedDecoder: unknown placement of '", name, "'");
  };
  const auto params = model.named_parameters(/*recurse=*/true);
  const size_t roles = static_cast<size_t>(detail::Role::kCount);
  layers_.assign(static_cast<size_t>(c.n_layers), std::vector<at::Tensor>(roles));
  for (int64_t l = 0; l < c.n_layers; ++l) windows_.push_back(c.window(l));
  for (const detail::NamedRow& entry : detail::parameter_names(c)) {
    const at::Tensor* param = params.find(entry.name);
    TORCH_CHECK(param, "CachedDecoder: the model has no parameter '", entry.name, "'");
    const at::Tensor local = part(entry.name, *param, entry.row->tp);
    switch (entry.row->role) {
      case detail::Role::kEmbedding:
        embedding_ = local;
        break;
      case detail::Role::kFinalNorm:
        norm_ = local;
        break;
      case detail::Role::kOutput:
        output_ = local;
        break;
      default:
        layers_[static_cast<size_t>(entry.layer)][static_cast<size_t>(entry.row->role)] = local;
    }
  }
  if (!output_.defined()) output_ = embedding_;  // tied: the head is the embedding
  vocab_offset_ = chunk_range(c.vocab_size, tp_, rank_).offset;
  rope_ = model.rope(c.max_seq_len, norm_.options());
  local_rope_ = rope_;
  for (int64_t i = 0; i < c.n_layers; ++i)
    if (c.window(i) > 0) local_rope_ = model.rope(c.max_seq_len, norm_.options(), i);
  // RMSNorm's default eps (none) is the dtype's epsilon; the model always sets norm_eps.
  eps_ = c.norm_eps;
}

at::Tensor CachedDecoder::all_reduce(const at::Tensor& t) const {
  if (tp_ == 1) return t;
  return comm::all_reduce(t, ReduceOp::Sum, mesh_->group(0));
}

at::Tensor CachedDecoder::embed(const at::Tensor& tokens) const {
  if (tp_ == 1) return at::embedding(embedding_, tokens);
  // Vocab rows are sharded: look up the tokens this rank holds, zeros elsewhere, then sum.
  const int64_t n = embedding_.size(0);
  const at::Tensor outside = (tokens < vocab_offset_) | (tokens >= vocab_offset_ + n);
  at::Tensor h;
  if (n == 0) {
    h = at::zeros({tokens.size(0), tokens.size(1), config_.dim}, embedding_.options());
  } else {
    h = at::embedding(embedding_, (tokens - vocab_offset_).masked_fill(outside, 0));
    h.masked_fill_(outside.unsqueeze(-1), 0);
  }
  return all_reduce(h);
}

namespace {

// The model's RMSNorm (dtensor::nn::rms_norm) over the last dimension.
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, const DecoderConfig& c, double eps) {
  return dtensor::nn::rms_norm(x, x.size(-1), weight, eps, c.norm_weight_offset,
                               c.norm_scale_in_float32);
}

}  // namespace

// A row-parallel projection: this rank's part of the contracted dim times its columns of w,
// summed over the TP ranks, the bias added once after the sum. In LayoutInvariantMode the sum
// is the mode's canonical one, the same bits at every TP degree, as in the modules' forward.
at::Tensor CachedDecoder::row_parallel(const at::Tensor& x, const at::Tensor& w,
                                       const at::Tensor& bias) const {
  at::Tensor out;
  if (ops::layout_invariant_segments() > 0) {
    out = detail::rows_padded(x.reshape({-1, x.size(-1)}), [&](const at::Tensor& rows) {
            return ops::canonical_mm(rows, w.t(), mesh_ ? &*mesh_ : nullptr, 0,
                                     "CachedDecoder::forward (row-parallel linear)");
          }).view({x.size(0), x.size(1), -1});
  } else if (tp_ == 1) {
    return at::linear(x, w, bias);
  } else {
    out = all_reduce(at::linear(x, w));
  }
  return bias.defined() ? out + bias : out;
}

// A column-parallel projection (this rank's columns of w): in LayoutInvariantMode with the rows
// padded as detail::rows_padded says, so that a decode step's row equals a prefill's.
at::Tensor CachedDecoder::column_parallel(const at::Tensor& x, const at::Tensor& w,
                                          const at::Tensor& bias) {
  return detail::rows_padded(x.reshape({-1, x.size(-1)}),
                             [&](const at::Tensor& rows) { return at::linear(rows, w, bias); })
      .view({x.size(0), x.size(1), -1});
}

at::Tensor CachedDecoder::forward(const at::Tensor& tokens_in, KVCache& cache) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(tokens_in.dim() == 2 && tokens_in.size(0) == cache.batch() && tokens_in.size(1) > 0,
              "CachedDecoder::forward: tokens must be (batch=", cache.batch(), ", seqlen>0), got ",
              tokens_in.sizes());
  const int64_t B = tokens_in.size(0), S = tokens_in.size(1), t0 = cache.length();
  TORCH_CHECK(t0 + S <= cache.max_len(), "CachedDecoder::forward: ", t0, " cached + ", S,
              " new positions exceed the cache's max_len=", cache.max_len());
  const int64_t hd = config_.head_dim();
  const auto wk_rows = [this] {
    return layers_[0][static_cast<size_t>(detail::Role::kWk)].size(0);
  };
  TORCH_CHECK(layers_.empty() || cache.keys(0).size(2) * hd == wk_rows(),
              "CachedDecoder::forward: the cache holds ", cache.keys(0).size(2),
              " KV heads per layer, this rank's model ", layers_.empty() ? 0 : wk_rows() / hd,
              "; build the KVCache from the same model");
  const auto device = norm_.device();
  const at::Tensor tokens = tokens_in.to(device, at::kLong);

  // Rotary positions count from each row's first real token; padded slots get position 0.
  const at::Tensor pad = cache.padding().to(device);
  const at::Tensor slots = at::arange(t0, t0 + S, tokens.options());
  const at::Tensor positions = (slots.unsqueeze(0) - pad.unsqueeze(1)).clamp_min(0);
  const at::Tensor rope = rope_.index_select(0, positions.flatten()).view({B, S, hd / 2, 2});
  const at::Tensor local_rope =
      local_rope_.index_select(0, positions.flatten()).view({B, S, hd / 2, 2});
  const double off = config_.norm_weight_offset;
  const double scale = config_.query_pre_attn_scalar > 0 ? config_.attention_scale() : 0;
  // One mask per distinct window (block_math.h: padding slots never seen, sliding windows).
  std::map<int64_t, at::Tensor> masks;
  for (const int64_t window : windows_) {
    if (!masks.count(window)) masks[window] = detail::attention_mask(t0, S, pad, window, device);
  }

  at::Tensor h = detail::scale_embeddings(embed(tokens), config_.dim, config_.scale_embeddings);
  using detail::Role;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const auto& w = layers_[l];
    auto W = [&w](Role role) -> const at::Tensor& { return w[static_cast<size_t>(role)]; };
    const int64_t window = windows_[l];
    const at::Tensor& r = window > 0 ? local_rope : rope;
    at::Tensor x = norm(h, W(Role::kAttentionNorm), config_, eps_);
    const at::Tensor q = detail::heads(column_parallel(x, W(Role::kWq), W(Role::kBq)), hd,
                                       W(Role::kQNorm), eps_, r, off);
    const at::Tensor k = detail::heads(column_parallel(x, W(Role::kWk), W(Role::kBk)), hd,
                                       W(Role::kKNorm), eps_, r, off);
    const at::Tensor v =
        detail::heads(column_parallel(x, W(Role::kWv), W(Role::kBv)), hd, {}, eps_, {});
    detail::LayerCache layer_cache{cache.keys(static_cast<int64_t>(l)),
                                   cache.values(static_cast<int64_t>(l)), t0};
    const at::Tensor attn =
        detail::attend(q, k, v, masks.at(window), &layer_cache, scale, W(Role::kSinks));
    at::Tensor o = row_parallel(attn, W(Role::kWo), W(Role::kBo));
    if (W(Role::kAttentionPostNorm).defined())
      o = norm(o, W(Role::kAttentionPostNorm), config_, eps_);
    h = h + o;
    x = norm(h, W(Role::kFfnNorm), config_, eps_);
    at::Tensor f;
    if (W(Role::kRouter).defined()) {
      // A sparse layer: this rank's columns of every expert (moe.h), summed over the ranks; b2
      // counts once, on rank 0.
      TORCH_CHECK(tp_ == 1 || ops::layout_invariant_segments() == 0,
                  "generate: LayoutInvariantMode with experts split over tp=", tp_,
                  " ranks is not built");
      const MoeOptions& o = config_.moe->options;
      const at::Tensor flat = x.reshape({-1, x.size(-1)});
      const Routing routing = route(flat, W(Role::kRouter), W(Role::kRouterBias), o);
      const ExpertWeights experts{W(Role::kExpertW1),
                                  W(Role::kExpertW2),
                                  W(Role::kExpertW3),
                                  W(Role::kExpertB1),
                                  rank_ == 0 ? W(Role::kExpertB2) : at::Tensor(),
                                  W(Role::kExpertB3)};
      f = all_reduce(experts_forward(flat, routing, experts, o)).view(x.sizes());
    } else {
      const at::Tensor gate = column_parallel(x, W(Role::kW1), {});
      const at::Tensor up = column_parallel(x, W(Role::kW3), {});
      f = row_parallel(detail::gated_activation(gate, up, config_.activation), W(Role::kW2), {});
    }
    if (W(Role::kFfnPostNorm).defined()) f = norm(f, W(Role::kFfnPostNorm), config_, eps_);
    h = h + f;
  }
  cache.advance(S);

  const at::Tensor last = norm(h.select(1, S - 1), norm_, config_, eps_);
  // (B, this rank's vocab rows)
  at::Tensor logits = detail::softcap(at::linear(last, output_), config_.final_logit_softcap);
  if (tp_ == 1) return logits;
  // The vocab shards (uneven ones too) gathered by the library's own S(1) -> R: one all-gather.
  const int64_t V = config_.vocab_size;
  const at::Tensor sharded =
      from_local(logits, *mesh_, {Shard(1)},
                 {.shape = std::vector<int64_t>{B, V}, .stride = std::vector<int64_t>{V, 1}});
  return full_tensor(sharded).contiguous();
}

// ---- sampling ----

at::Tensor sample_next_tokens(const at::Tensor& logits, const SamplingOptions& o, int64_t step) {
  TORCH_CHECK(logits.dim() == 2, "sample_next_tokens: logits must be (batch, vocab), got ",
              logits.sizes());
  TORCH_CHECK(o.temperature >= 0, "sampling: temperature must be >= 0, got ", o.temperature);
  TORCH_CHECK(o.top_k >= 0, "sampling: top_k must be >= 0 (0: off), got ", o.top_k);
  TORCH_CHECK(o.top_p > 0 && o.top_p <= 1, "sampling: top_p must be in (0, 1], got ", o.top_p);
  const at::Tensor x64 = logits.detach().to(at::kCPU, at::kDouble);
  if (o.temperature == 0) return x64.argmax(-1);
  at::Tensor x = x64 / o.temperature;
  const int64_t V = x.size(1);
  if (o.top_k > 0 && o.top_k < V) {
    const at::Tensor kth = std::get<0>(x.topk(o.top_k, -1)).narrow(1, o.top_k - 1, 1);
    x = x.masked_fill(x < kth, -std::numeric_limits<double>::infinity());
  }
  auto [sorted, order] = at::sort(x.softmax(-1), /*stable=*/true, -1, /*descending=*/true);
  if (o.top_p < 1) {
    // Keep a token while the probability before it is below top_p (the first always stays).
    const at::Tensor before = sorted.cumsum(-1) - sorted;
    sorted = sorted.masked_fill(before >= o.top_p, 0);
  }
  const at::Tensor cdf = sorted.cumsum(-1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(mix(o.seed, static_cast<uint64_t>(step)));
  const at::Tensor u = at::rand({x.size(0), 1}, gen, at::kDouble) * cdf.narrow(1, V - 1, 1);
  const at::Tensor pick = (cdf < u).sum(-1, /*keepdim=*/true).clamp_max(V - 1);
  return order.gather(1, pick).squeeze(1);
}

// ---- generate ----

GenerateResult generate(const TransformerImpl& model,
                        const std::vector<std::vector<int64_t>>& prompts,
                        const GenerateOptions& options) {
  using Clock = std::chrono::steady_clock;
  const int64_t B = static_cast<int64_t>(prompts.size());
  TORCH_CHECK(B > 0, "generate: no prompts");
  TORCH_CHECK(options.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got ",
              options.max_new_tokens);
  const int64_t V = model.config().vocab_size;
  int64_t longest = 0;
  GenerateResult result;
  for (size_t b = 0; b < prompts.size(); ++b) {
    TORCH_CHECK(!prompts[b].empty(), "generate: prompt ", b, " is empty");
    for (int64_t t : prompts[b])
      TORCH_CHECK(t >= 0 && t < V, "generate: prompt ", b, " holds token ", t,
                  " outside the vocabulary [0, ", V, ")");
    longest = std::max<int64_t>(longest, static_cast<int64_t>(prompts[b].size()));
    result.prompt_tokens += static_cast<int64_t>(prompts[b].size());
  }
  result.tokens.resize(B);
  if (options.max_new_tokens == 0) return result;
  // The last new token is never fed back, so the cache needs one slot fewer.
  const int64_t max_len = longest + options.max_new_tokens - 1;
  TORCH_CHECK(max_len <= model.config().max_seq_len, "generate: the longest prompt (", longest,
              " tokens) plus max_new_tokens=", options.max_new_tokens,
              " - 1 exceeds max_seq_len=", model.config().max_seq_len);

  at::Tensor tokens = at::full({B, longest}, options.pad_token, at::kLong);
  at::Tensor padding = at::empty({B}, at::kLong);
  for (int64_t b = 0; b < B; ++b) {
    const auto n = static_cast<int64_t>(prompts[b].size());
    padding[b] = longest - n;
    tokens[b].narrow(0, longest - n, n).copy_(at::tensor(prompts[b], at::kLong));
  }
  CachedDecoder decoder(model);
  KVCache cache(model, B, std::max<int64_t>(max_len, longest));
  cache.set_padding(padding);

  auto start = Clock::now();
  at::Tensor logits = decoder.forward(tokens, cache);
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  start = Clock::now();
  std::vector<bool> running(B, true);
  int64_t alive = B;
  for (int64_t step = 0;; ++step) {
    if (options.on_logits) options.on_logits(logits);
    const at::Tensor next = sample_next_tokens(logits, options, step);
    const auto* ids = next.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      if (!running[b]) continue;
      result.tokens[b].push_back(ids[b]);
      ++result.new_tokens;
      if (options.on_token) options.on_token(b, ids[b]);
      const auto& stop = options.stop_tokens;
      if (std::find(stop.begin(), stop.end(), ids[b]) != stop.end() ||
          static_cast<int64_t>(result.tokens[b].size()) == options.max_new_tokens) {
        running[b] = false;
        --alive;
      }
    }
    if (alive == 0) break;
    logits = decoder.forward(next.view({B, 1}), cache);
    ++result.decode_steps;
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

}  // namespace dtensor::models
