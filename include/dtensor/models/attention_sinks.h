#pragma once
// Attention with per-head sinks (gpt-oss): each query head's softmax runs over its scores and one
// learned logit more, the sink, whose probability is then dropped, so a row's weights may sum to
// less than one ("attend to nothing").
#include <ATen/core/Tensor.h>

namespace dtensor::models {

/// q (B, S, Hq, D) over k, v (B, T, Hkv, D) (query head j uses KV head j / (Hq / Hkv)) with
/// `sinks` (Hq) and `mask` (boolean, broadcastable to (B, 1, S, T): which keys each query sees;
/// undefined: causal with S == T). Returns (B, S, Hq * D). transformers' eager_attention_forward of
/// gpt-oss step for step (scores times `scale`, the masked scores and the sink concatenated, their
/// row maximum subtracted, a softmax in the scores' dtype, the sink's column dropped, the values
/// weighted), so bfloat16 gives its bits.
at::Tensor attend_with_sinks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& sinks, const at::Tensor& mask, double scale);

}  // namespace dtensor::models
