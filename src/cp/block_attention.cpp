// One key block's attention and the merge of blocks (block_attention.h).
#include "block_attention.h"

#include <ATen/ATen.h>

#include <limits>
#include <optional>

namespace dtensor::cp::detail {
namespace {

std::optional<double> scale_arg(double scale) {
  return scale > 0 ? std::optional<double>(scale) : std::nullopt;
}

std::optional<at::Tensor> mask_arg(const BlockTask& task, int64_t window, const at::Tensor& like) {
  if (task.kind != BlockKind::masked) return std::nullopt;
  return block_mask(task, window, like.options());
}

void check_device(const at::Tensor& q) {
  TORCH_CHECK_NOT_IMPLEMENTED(q.device().is_cpu() || q.is_meta(),
                              "cp::context_attention: runs on CPU tensors (LibTorch's CPU flash "
                              "attention kernel) and meta tensors; got a ",
                              q.device().str(), " tensor");
}

}  // namespace

at::Tensor repeat_heads(const at::Tensor& kv, int64_t rep) {
  if (rep == 1) return kv;
  const auto s = kv.sizes();
  return kv.unsqueeze(2).expand({s[0], s[1], rep, s[2], s[3]}).reshape({s[0], -1, s[2], s[3]});
}

at::Tensor sum_head_groups(const at::Tensor& grad, int64_t rep) {
  if (rep == 1) return grad;
  const auto s = grad.sizes();
  return grad.view({s[0], s[1] / rep, rep, s[2], s[3]}).sum(2);
}

std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const BlockTask& task,
                                                int64_t window, double scale) {
  check_device(q);
  const std::optional<at::Tensor> mask = mask_arg(task, window, q);
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q, k, v, /*dropout_p=*/0.0, /*is_causal=*/task.kind == BlockKind::causal, mask,
      scale_arg(scale));
  if (mask) {
    // The kernel reports lse 0 for a query whose keys are all masked; it saw none.
    const at::Tensor sees_any = mask->amax(-1).isfinite();  // (lq,)
    lse = lse.masked_fill(sees_any.logical_not(), -std::numeric_limits<double>::infinity());
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const BlockTask& task, int64_t window,
    double scale) {
  check_device(q);
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(
      grad_out, q, k, v, out, lse, /*dropout_p=*/0.0,
      /*is_causal=*/task.kind == BlockKind::causal, mask_arg(task, window, q), scale_arg(scale));
}

std::pair<at::Tensor, at::Tensor> merge_blocks(const at::Tensor& acc_out, const at::Tensor& acc_lse,
                                               const at::Tensor& out, const at::Tensor& lse) {
  const at::Tensor merged = at::logaddexp(acc_lse, lse);
  // -inf - -inf is nan where neither block saw a key: such a query's weights are 0.
  const at::Tensor w_acc = (acc_lse - merged).exp().nan_to_num_(0.0).unsqueeze(-1);
  const at::Tensor w_new = (lse - merged).exp().nan_to_num_(0.0).unsqueeze(-1);
  return {acc_out * w_acc + out.to(acc_out.scalar_type()) * w_new, merged};
}

}  // namespace dtensor::cp::detail
