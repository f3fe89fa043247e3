// Attention with per-head sinks (attention_sinks.h).
#include "dtensor/models/attention_sinks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <limits>

namespace dtensor::models {

at::Tensor attend_with_sinks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& sinks, const at::Tensor& mask, double scale) {
  const int64_t B = q.size(0), S = q.size(1), nq = q.size(2), T = k.size(1), nkv = k.size(2);
  TORCH_CHECK(nkv > 0 && nq % nkv == 0, "attention: ", nq, " local query heads cannot share ", nkv,
              " local KV heads evenly");
  TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == nq, "attention: ", sinks.sizes(), " sinks for ",
              nq, " local query heads");
  // (B, H, T, D) with each KV head repeated for the query heads that use it.
  auto heads = [&](const at::Tensor& x) {
    const at::Tensor h = x.transpose(1, 2);
    if (nq == nkv) return h;
    return h.unsqueeze(2).expand({B, nkv, nq / nkv, T, x.size(3)}).reshape({B, nq, T, x.size(3)});
  };
  at::Tensor seen = mask;
  if (!seen.defined()) {
    TORCH_CHECK(S == T, "attention: a causal mask needs as many queries as keys, got ", S, " and ",
                T);
    const at::Tensor i = at::arange(S, q.options().dtype(at::kLong));
    seen = (i.view({1, -1}) <= i.view({-1, 1})).view({1, 1, S, T});
  }
  const at::Tensor scores =
      (at::matmul(q.transpose(1, 2), heads(k).transpose(2, 3)) * scale)
          .masked_fill(seen.logical_not(), -std::numeric_limits<double>::infinity());
  at::Tensor combined = at::cat(
      {scores, sinks.to(scores.scalar_type()).view({1, -1, 1, 1}).expand({B, nq, S, 1})}, -1);
  combined = combined - std::get<0>(combined.max(-1, /*keepdim=*/true));
  const at::Tensor probs = at::softmax(combined, -1, combined.scalar_type()).narrow(-1, 0, T);
  return at::matmul(probs, heads(v)).transpose(1, 2).contiguous().view({B, S, -1});
}

}  // namespace dtensor::models
