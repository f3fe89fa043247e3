// Meta kernels for the operators a training step of the decoder runs whose meta
// implementations PyTorch writes in Python (torch/_meta_registrations.py), so LibTorch alone
// has none: without them the step cannot run on the meta device. Each computes only the
// output's shape, dtype and strides, as the Python one does.
#include "meta_kernels.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <torch/library.h>

namespace dtensor::plan {
namespace {

at::Tensor& logical_out(const at::Tensor& self, const at::Tensor& other, at::Tensor& out) {
  out.resize_(at::infer_size(self.sizes(), other.sizes()));
  return out;
}

at::Tensor& logical_not_out(const at::Tensor& self, at::Tensor& out) {
  out.resize_(self.sizes());
  return out;
}

at::Tensor index_select(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  std::vector<int64_t> shape = self.sizes().vec();
  if (!shape.empty()) shape[c10::maybe_wrap_dim(dim, self.dim())] = index.numel();
  return at::empty(shape, self.options());
}

// The MoE experts' rows -> tokens (experts_forward).
at::Tensor floor_divide(const at::Tensor& self, const at::Tensor& other) {
  return at::empty(at::infer_size(self.sizes(), other.sizes()),
                   self.options().dtype(at::result_type(self, other)));
}

at::Tensor floor_divide_scalar(const at::Tensor& self, const at::Scalar& other) {
  return at::empty(self.sizes(), self.options().dtype(at::result_type(self, other)));
}

at::Tensor embedding_dense_backward(const at::Tensor& grad, const at::Tensor&, c10::SymInt num,
                                    c10::SymInt, bool) {
  return at::empty({num.expect_int(), grad.size(-1)}, grad.options());
}

at::Tensor where(const at::Tensor& cond, const at::Tensor& self, const at::Tensor& other) {
  const auto shape = at::infer_size(at::infer_size(cond.sizes(), self.sizes()), other.sizes());
  return at::empty(shape, self.options().dtype(at::result_type(self, other)));
}

// The CPU's choice for the model's inputs (dense, no dropout): the flash kernel
// (sdp::SDPBackend::flash_attention). LibTorch's meta choice would be the math path, which
// keeps the whole attention matrix for backward and would misstate the memory.
int64_t fused_sdp_choice(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const std::optional<at::Tensor>&, double, bool, std::optional<double>,
                         bool) {
  return 1;
}

// As the CPU kernel lays them out: out (B, H, L, Ev) over (B, L, H, Ev) memory, logsumexp
// (B, H, L) in float over (B, L, H).
std::tuple<at::Tensor, at::Tensor> flash_cpu(const at::Tensor& q, const at::Tensor&,
                                             const at::Tensor& v, double, bool,
                                             const std::optional<at::Tensor>&,
                                             std::optional<double>) {
  const int64_t b = q.size(0), h = q.size(1), l = q.size(2), e = v.size(3);
  at::Tensor out = at::empty({b, l, h, e}, q.options()).transpose(1, 2);
  at::Tensor lse = at::empty({b, l, h}, q.options().dtype(at::kFloat)).transpose(1, 2);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_cpu_backward(
    const at::Tensor&, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor&, const at::Tensor&, double, bool, const std::optional<at::Tensor>&,
    std::optional<double>) {
  return {at::empty_like(q), at::empty_like(k), at::empty_like(v)};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("logical_or.out", logical_out);
  m.impl("logical_and.out", logical_out);
  m.impl("logical_not.out", logical_not_out);
  m.impl("index_select", index_select);
  m.impl("floor_divide", floor_divide);
  m.impl("floor_divide.Scalar", floor_divide_scalar);
  m.impl("embedding_dense_backward", embedding_dense_backward);
  m.impl("where.self", where);
  m.impl("_fused_sdp_choice", fused_sdp_choice);
  m.impl("_scaled_dot_product_flash_attention_for_cpu", flash_cpu);
  m.impl("_scaled_dot_product_flash_attention_for_cpu_backward", flash_cpu_backward);
}

void use_meta_kernels() {}

}  // namespace dtensor::plan
