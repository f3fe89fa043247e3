#pragma once
// Attention over one key block and the online softmax that combines blocks: each block gives its
// output and the log-sum-exp of its scores per query; blocks merge by weighting each output with
// exp(its lse - the merged lse) (flash attention's combination). The backward of one block, given
// the merged output and lse, is that block's exact share of the gradients.
#include <ATen/core/Tensor.h>

#include <utility>

#include "attention_plan.h"

namespace dtensor::cp::detail {

// (b, Hkv, L, D) -> (b, Hkv * rep, L, D): query head j uses KV head j / rep.
at::Tensor repeat_heads(const at::Tensor& kv, int64_t rep);
// The inverse for gradients: (b, Hkv * rep, L, D) -> (b, Hkv, L, D), summed over each group.
at::Tensor sum_head_groups(const at::Tensor& grad, int64_t rep);

// Attention of q (b, H, lq, D) over k, v (b, H, lk, D) as the task says: (out (b, H, lq, D),
// lse (b, H, lq)), lse -inf for a query that sees none of these keys.
std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const BlockTask& task,
                                                int64_t window, double scale);

// Gradients (dq, dk, dv) of one block given the gradient of the merged output, the merged output
// and its lse (+inf for a query that sees no key at all: it then contributes nothing).
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const BlockTask& task, int64_t window,
    double scale);

// One block's (out, lse) folded into the running (acc_out, acc_lse) of the same queries:
// lse' = logaddexp(acc_lse, lse), out' = acc_out e^(acc_lse - lse') + out e^(lse - lse'); a query
// with both -inf stays 0 with lse -inf.
std::pair<at::Tensor, at::Tensor> merge_blocks(const at::Tensor& acc_out, const at::Tensor& acc_lse,
                                               const at::Tensor& out, const at::Tensor& lse);

}  // namespace dtensor::cp::detail
