// Slicing and selecting: slice, select, their backward ops and scatters, as iteration spaces
// (strategy/iteration_space.h).
#include "dtensor/ops/rule_utils.h"
#include "strategy/iteration_space.h"

namespace dtensor::ops {
namespace {

using namespace iteration;  // Space, Operand, Lin, decide, ...

// Whether slice(dim, start, end, step) keeps all of a dim of size n.
bool whole_slice(const c10::IValue& start, const c10::IValue& end, int64_t step, int64_t n) {
  int64_t b = start.isNone() ? 0 : start.toInt();
  int64_t e = end.isNone() ? n : end.toInt();
  if (b < 0) b += n;
  if (e < 0) e += n;
  return step == 1 && b <= 0 && e >= n;
}

Decision slice(const OpCall& call) {
  const auto& in = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(1, 0), in.ndim());
  const bool whole = whole_slice(call.arg(2), call.arg(3), call.int_arg(4, 1), in.shape()[dim]);
  Space s = same_shape_space(call, in.shape(),
                             whole ? std::vector<int64_t>{} : std::vector<int64_t>{dim});
  s.lin = Lin::Select;
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

// Backward ops that build a zero tensor of `input_sizes` (arg 1) around the gradient: the
// sizes are rewritten to this rank's shard of the result.
Decision with_local_sizes(const OpCall& call, Decision d, c10::IntArrayRef global_sizes) {
  d.local_args.push_back(
      {1, c10::IValue(local_shape_of(call.mesh(), global_sizes, *d.outputs[0]))});
  return d;
}

// slice_backward(grad, input_sizes, dim, start, end, step)
Decision slice_backward(const OpCall& call) {
  const auto& g = call.input(0);
  const auto sizes = call.int_list_arg(1);
  const int64_t dim = wrap_dim(call.int_arg(2), static_cast<int64_t>(sizes.size()));
  const bool whole = g.shape()[dim] == sizes[dim];
  Space s =
      same_shape_space(call, sizes, whole ? std::vector<int64_t>{} : std::vector<int64_t>{dim});
  s.lin = Lin::Select;
  Operand& o = identity_operand(s, 0, g.ndim(), true);
  if (!whole) o.dims[dim] = -1;
  return with_local_sizes(call, decide(call, s), sizes);
}

Decision select(const OpCall& call) {
  const auto& in = call.input(0);
  return decide(call, dropping_dim_space(call, in, wrap_dim(call.int_arg(1), in.ndim())));
}

// select_backward(grad, input_sizes, dim, index)
Decision select_backward(const OpCall& call) {
  const auto sizes = call.int_list_arg(1);
  const int64_t nd = static_cast<int64_t>(sizes.size());
  const int64_t dim = wrap_dim(call.int_arg(2), nd);
  Space s = same_shape_space(call, sizes, {dim});
  s.lin = Lin::Select;
  Operand& o = s.operand(0, true);
  for (int64_t L = 0; L < nd; ++L) {
    if (L != dim) o.dims[L] = L < dim ? L : L - 1;
  }
  return with_local_sizes(call, decide(call, s), sizes);
}

// slice_scatter(self, src, dim, start, end, step) / select_scatter(self, src, dim, index)
Decision slice_scatter(const OpCall& call) {
  const auto& self = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(2, 0), self.ndim());
  const bool whole = whole_slice(call.arg(3), call.arg(4), call.int_arg(5, 1), self.shape()[dim]);
  Space s = same_shape_space(call, self.shape(),
                             whole ? std::vector<int64_t>{} : std::vector<int64_t>{dim});
  s.lin = Lin::Select;
  identity_operand(s, 0, self.ndim(), true);
  Operand& src = identity_operand(s, 1, self.ndim(), true);
  if (!whole) src.dims[dim] = -1;
  return decide(call, s);
}

Decision select_scatter(const OpCall& call) {
  const auto& self = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(2), self.ndim());
  Space s = same_shape_space(call, self.shape(), {dim});
  s.lin = Lin::Select;
  identity_operand(s, 0, self.ndim(), true);
  Operand& src = s.operand(1, true);
  for (int64_t L = 0; L < self.ndim(); ++L) {
    if (L != dim) src.dims[L] = L < dim ? L : L - 1;
  }
  return decide(call, s);
}

}  // namespace

DTENSOR_RULES(slice_ops) {
  using dispatch::register_rule;
  register_rule("aten::slice.Tensor", slice);
  register_rule("aten::slice_backward", slice_backward);
  register_rule("aten::slice_scatter", slice_scatter);
  register_rule("aten::select.int", select);
  register_rule("aten::select_backward", select_backward);
  register_rule("aten::select_scatter", select_scatter);
}

}  // namespace dtensor::ops
