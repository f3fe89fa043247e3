// Joining and splitting: cat, stack, split, unbind, as iteration spaces
// (strategy/iteration_space.h); tensor_split by a tensor, as a decomposition.
#include <ATen/ops/tensor_split.h>

#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/ops/rule_utils.h"
#include "strategy/iteration_space.h"

namespace dtensor::ops {
namespace {

using namespace iteration;  // Space, Operand, Lin, decide, ...

bool legacy_empty(const DTensorSpec& t) { return t.ndim() == 1 && t.shape()[0] == 0; }

Decision cat(const OpCall& call) {
  const size_t n = call.num_inputs();
  int64_t ref = -1;
  for (size_t j = 0; j < n && ref < 0; ++j) {
    if (!legacy_empty(call.input(j))) ref = static_cast<int64_t>(j);
  }
  if (ref < 0) {  // only 1-D empty tensors: nothing to move
    return all_outputs(call, std::vector<Placements>(n), replicate_all(call.mesh_ndim()));
  }
  const auto& r = call.input(ref);
  const int64_t dim = wrap_dim(call.int_arg(1, 0), r.ndim());
  std::vector<int64_t> shape = r.shape();
  shape[dim] = 0;
  for (size_t j = 0; j < n; ++j) {
    if (!legacy_empty(call.input(j))) shape[dim] += call.input(j).shape()[dim];
  }
  Space s = same_shape_space(call, shape, {dim});
  s.lin = Lin::Select;
  for (size_t j = 0; j < n; ++j) {
    if (legacy_empty(call.input(j))) {
      s.as_is[j] = true;  // skipped by cat; empty on every rank whatever its layout
    } else {
      identity_operand(s, j, r.ndim(), true, {dim});
    }
  }
  return decide(call, s);
}

Decision stack(const OpCall& call) {
  const auto& r = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(1, 0), r.ndim() + 1);
  Space s(call.num_inputs());
  s.lin = Lin::Select;
  for (int64_t L = 0; L <= r.ndim(); ++L) {
    s.add_dim(L == dim ? static_cast<int64_t>(call.num_inputs()) : r.shape()[L < dim ? L : L - 1],
              L, L != dim);
  }
  for (size_t j = 0; j < call.num_inputs(); ++j) {
    Operand& o = s.operand(j, true);
    for (int64_t L = 0; L <= r.ndim(); ++L) {
      if (L != dim) o.dims[L] = L < dim ? L : L - 1;
    }
  }
  return decide(call, s);
}

// split.Tensor / split_with_sizes (self, sizes, dim): every piece keeps the other dims' layout.
Decision split(const OpCall& call) {
  const auto& in = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(2, 0), in.ndim());
  Space s = same_shape_space(call, in.shape(), {dim});
  s.lin = Lin::Select;
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

Decision unbind(const OpCall& call) {
  const auto& in = call.input(0);
  return decide(call, dropping_dim_space(call, in, wrap_dim(call.int_arg(1, 0), in.ndim())));
}

// tensor_split by a tensor of indices or sections: LibTorch's decomposition reads that tensor's
// memory. A DTensor's values are read as a replica (every rank gets the same), as PyTorch's
// DTensor reads them with tolist(); then the split by sections or indices decomposes into views.
void tensor_split_by_tensor(std::vector<c10::IValue>& stack) {
  const int64_t dim = stack.back().toInt();
  const at::Tensor by = stack[stack.size() - 2].toTensor();
  const at::Tensor self = stack[stack.size() - 3].toTensor();
  torch::jit::drop(stack, 3);
  TORCH_CHECK(by.device().is_cpu(),
              "tensor_split expected tensor_indices_or_sections to be on cpu, ", "but it's on ",
              by.device());
  TORCH_CHECK(by.scalar_type() == at::kLong, "tensor_split expected tensor_indices_or_sections to ",
              "have dtype of long, but got ", by.scalar_type());
  TORCH_CHECK(by.dim() <= 1,
              "tensor_split expected tensor_indices_or_sections to be a zero-dimensional ",
              "or one-dimensional tensor, but got a tensor with ", by.dim(), " dims");
  const at::Tensor values = (is_dtensor(by) ? full_tensor(by) : by).contiguous();
  if (values.dim() == 0) {
    stack.emplace_back(at::tensor_split(self, values.item<int64_t>(), dim));
  } else {
    const std::vector<int64_t> indices(values.data_ptr<int64_t>(),
                                       values.data_ptr<int64_t>() + values.numel());
    stack.emplace_back(at::tensor_split(self, indices, dim));
  }
}

}  // namespace

DTENSOR_RULES(concat_ops) {
  using dispatch::register_rule;
  register_rule("aten::cat", cat);
  register_rule("aten::stack", stack);
  register_rule(
      {"aten::split.Tensor", "aten::split_with_sizes", "aten::unsafe_split.Tensor",
       "aten::unsafe_split_with_sizes", "aten::split_with_sizes_copy", "aten::split_copy.Tensor"},
      split);
  register_rule("aten::unbind.int", unbind);
  dispatch::register_decomposition("aten::tensor_split.tensor_indices_or_sections",
                                   tensor_split_by_tensor);
}

}  // namespace dtensor::ops
