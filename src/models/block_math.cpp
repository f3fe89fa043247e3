// The decoder block's math shared by training, pipeline stages and generation (block_math.h).
#include "block_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "dtensor/models/attention_sinks.h"
#include "dtensor/nn/layers.h"
#include "dtensor/ops/layout_invariant.h"
#include "rotary.h"

namespace dtensor::models::detail {

at::Tensor heads(const at::Tensor& x, int64_t head_dim, const at::Tensor& norm_weight, double eps,
                 const at::Tensor& rope, double norm_offset) {
  // -1: the heads this rank holds (all of them without TP).
  at::Tensor h = x.view({x.size(0), x.size(1), -1, head_dim});
  if (norm_weight.defined()) h = dtensor::nn::rms_norm(h, head_dim, norm_weight, eps, norm_offset);
  if (!rope.defined()) return h;
  return rotate_pairs(h, rope.select(-1, 0).unsqueeze(2), rope.select(-1, 1).unsqueeze(2));
}

at::Tensor attention_mask(int64_t start, int64_t S, const at::Tensor& padding, int64_t window,
                          const at::Device& device) {
  if (start == 0 && !padding.defined() && window <= 0) return {};
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor keys = at::arange(start + S, options).view({1, 1, -1});
  const at::Tensor queries = at::arange(start, start + S, options).view({1, -1, 1});
  at::Tensor seen = keys <= queries;
  if (padding.defined()) seen = seen & (keys >= padding.to(device).view({-1, 1, 1}));
  if (window > 0) seen = seen & (keys > queries - window);
  return (seen | (keys == queries)).unsqueeze(1);
}

namespace {

// (B, T, n_kv, D) -> (B, T, n_kv * n_rep, D): query head j uses KV head j / n_rep.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const auto s = x.sizes();
  return x.unsqueeze(3).expand({s[0], s[1], s[2], n_rep, s[3]}).reshape({s[0], s[1], -1, s[3]});
}

}  // namespace

at::Tensor rows_padded(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& f) {
  const int64_t m = x.size(0);
  if (m >= kInvariantMinRows || ops::layout_invariant_segments() == 0) return f(x);
  const at::Tensor padded =
      at::cat({x, at::zeros({kInvariantMinRows - m, x.size(1)}, x.options())});
  return f(padded).narrow(0, 0, m);
}

namespace {

// The layout-invariant mode's attention with a cache (see attend): the slots filled so far
// rounded up to a multiple of kInvariantKeyBlock (zero slots past the cache's end), a boolean
// mask over them, and at least kInvariantMinRows queries (the last one repeated, its outputs
// dropped). Whole blocks of masked slots leave this LibTorch's attention bits unchanged, so a
// decode step at slot t and a prefill through slot t give its row the same bits, whatever the
// cache's size.
at::Tensor attend_in_blocks(const at::Tensor& q, const at::Tensor& mask, const LayerCache& cache,
                            double scale) {
  const int64_t B = q.size(0), S = q.size(1), filled = cache.start + S;
  const int64_t capacity =
      (filled + kInvariantKeyBlock - 1) / kInvariantKeyBlock * kInvariantKeyBlock;
  auto slots = [&](const at::Tensor& kv) {
    const int64_t have = std::min(capacity, kv.size(1));
    at::Tensor out = kv.narrow(1, 0, have);
    if (have == capacity) return out;
    std::vector<int64_t> rest = kv.sizes().vec();
    rest[1] = capacity - have;
    return at::cat({out, at::zeros(rest, kv.options())}, 1);
  };
  at::Tensor within = mask.defined() ? mask : attention_mask(cache.start, S, {}, 0, q.device());
  if (!within.defined()) {  // plain causal from slot 0
    const auto options = at::TensorOptions().dtype(at::kLong).device(q.device());
    within = (at::arange(filled, options).view({1, -1}) <= at::arange(S, options).view({-1, 1}))
                 .view({1, 1, S, filled});
  }
  at::Tensor seen = at::zeros({within.size(0), 1, S, capacity}, within.options());
  seen.narrow(3, 0, filled).copy_(within);
  at::Tensor queries = q;
  if (S < kInvariantMinRows) {
    const int64_t extra = kInvariantMinRows - S;
    queries = at::cat({q, q.narrow(1, S - 1, 1).expand({B, extra, q.size(2), q.size(3)})}, 1);
    seen = at::cat({seen, seen.narrow(2, S - 1, 1).expand({seen.size(0), 1, extra, capacity})}, 2);
  }
  const int64_t nq = q.size(2), nkv = cache.keys.size(2);
  TORCH_CHECK(nkv > 0 && nq % nkv == 0, "attention: ", nq, " local query heads cannot share ", nkv,
              " local KV heads evenly");
  const at::Tensor keys = repeat_kv(slots(cache.keys), nq / nkv);
  const at::Tensor values = repeat_kv(slots(cache.values), nq / nkv);
  // The math of attention spelled out (SDPA's kernels cut the queries into blocks whose sizes
  // follow their number): scores, masked softmax over the slots, weighted values.
  const double s = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const at::Tensor scores =
      at::matmul(queries.transpose(1, 2), keys.permute({0, 2, 3, 1}))
          .mul_(s)
          .masked_fill_(seen.logical_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor out = at::matmul(at::softmax(scores, -1), values.transpose(1, 2));
  return out.transpose(1, 2).narrow(1, 0, S).contiguous().view({B, S, -1});
}

}  // namespace

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& mask, LayerCache* cache, double scale,
                  const at::Tensor& sinks) {
  const int64_t B = q.size(0), S = q.size(1);
  at::Tensor keys = k, values = v;
  if (cache) {
    cache->keys.narrow(1, cache->start, S).copy_(k);
    cache->values.narrow(1, cache->start, S).copy_(v);
    TORCH_CHECK(!sinks.defined() || ops::layout_invariant_segments() == 0,
                "attention: sinks in LayoutInvariantMode generation are not built");
    if (ops::layout_invariant_segments() > 0) return attend_in_blocks(q, mask, *cache, scale);
    keys = cache->keys.narrow(1, 0, cache->start + S);
    values = cache->values.narrow(1, 0, cache->start + S);
  }
  if (sinks.defined()) {
    const double s = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    return attend_with_sinks(q, keys, values, sinks, mask, s);
  }
  const int64_t nq = q.size(2), nkv = keys.size(2);
  TORCH_CHECK(nkv > 0 && nq % nkv == 0, "attention: ", nq, " local query heads cannot share ", nkv,
              " local KV heads evenly");
  keys = repeat_kv(keys, nq / nkv);
  values = repeat_kv(values, nq / nkv);
  // On the meta device (dtensor_plan) LibTorch picks the math kernel, which keeps the whole
  // attention matrix for backward; a CPU run picks the flash kernel, so that one is called there
  // and the simulated step keeps what a real one keeps.
  const std::optional<double> s = scale > 0 ? std::optional(scale) : std::nullopt;
  at::Tensor out = q.is_meta() && !mask.defined()
                       ? std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
                             q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                             /*dropout_p=*/0.0, /*is_causal=*/true, /*attn_mask=*/std::nullopt, s))
                       : at::scaled_dot_product_attention(
                             q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                             mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                             /*dropout_p=*/0.0, /*is_causal=*/!mask.defined(), s);
  return out.transpose(1, 2).contiguous().view({B, S, -1});
}

at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& up,
                            const std::string& activation) {
  if (activation == "gelu_tanh") return at::gelu(gate, "tanh") * up;
  return at::silu(gate) * up;
}

at::Tensor softcap(const at::Tensor& x, double cap) {
  if (cap <= 0) return x;
  return at::tanh(x / cap) * cap;
}

at::Tensor scale_embeddings(const at::Tensor& h, int64_t dim, bool scale) {
  if (!scale) return h;
  return h * at::scalar_tensor(std::sqrt(static_cast<double>(dim)), h.options());
}

}  // namespace dtensor::models::detail
