// Ops that move elements within a tensor: repeat, roll, flip, triangles, constant padding and the
// complex views, as iteration spaces (strategy/iteration_space.h).
#include "dtensor/ops/rule_utils.h"
#include "strategy/iteration_space.h"

namespace dtensor::ops {
namespace {

using namespace iteration;  // Space, Operand, Lin, decide, ...

Decision repeat(const OpCall& call) {
  const auto& in = call.input(0);
  const auto reps = call.int_list_arg(1);
  const int64_t nd = static_cast<int64_t>(reps.size());
  const int64_t off = nd - in.ndim();
  Space s(call.num_inputs());
  for (int64_t L = 0; L < nd; ++L) {
    const int64_t base = L >= off ? in.shape()[L - off] : 1;
    s.add_dim(base * reps[L], L, L >= off && reps[L] == 1);
  }
  s.lin = Lin::Select;
  Operand& o = s.operand(0, true);
  for (int64_t d = 0; d < in.ndim(); ++d) o.dims[d + off] = d;
  return decide(call, s);
}

// Ops that move elements along some dims (which must be whole) and keep the others.
Decision along_dims(const OpCall& call, std::vector<int64_t> dims, Lin lin) {
  const auto& in = call.input(0);
  for (auto& d : dims) d = wrap_dim(d, in.ndim());
  Space s = same_shape_space(call, in.shape(), dims);
  s.lin = lin;
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

Decision roll(const OpCall& call) {
  auto dims = call.int_list_arg(2);
  if (dims.empty()) dims = iota(call.input(0).ndim());  // rolls the flattened tensor
  return along_dims(call, dims, Lin::Select);
}

Decision flip(const OpCall& call) { return along_dims(call, call.int_list_arg(1), Lin::Select); }

// triu/tril: the mask depends on the position in the last two dims. Zeroing is linear.
Decision triangle(const OpCall& call) {
  const int64_t nd = call.input(0).ndim();
  return along_dims(call, {nd - 2, nd - 1}, Lin::Select);
}

// constant_pad_nd(self, pad, value): padded dims whole. The pad value is not part of the
// cache key, so Partial is always reduced (a non-zero value would be added once per rank).
Decision constant_pad(const OpCall& call) {
  const int64_t nd = call.input(0).ndim();
  const auto pad = call.int_list_arg(1);
  std::vector<int64_t> dims;
  // pad holds (before, after) pairs starting from the last dim
  for (int64_t k = 0; 2 * k < static_cast<int64_t>(pad.size()) && k < nd; ++k) {
    const int64_t before = pad[2 * k];
    const int64_t after = 2 * k + 1 < static_cast<int64_t>(pad.size()) ? pad[2 * k + 1] : 0;
    if (before != 0 || after != 0) dims.push_back(nd - 1 - k);
  }
  return along_dims(call, dims, Lin::None);
}

// view_as_complex: the trailing pair becomes one complex element; view_as_real splits it.
Decision view_as_complex(const OpCall& call) {
  const auto& in = call.input(0);
  const int64_t last = in.ndim() - 1;
  Space s(call.num_inputs());
  for (int64_t L = 0; L < in.ndim(); ++L) s.add_dim(in.shape()[L], L == last ? -1 : L, L != last);
  s.lin = Lin::Sum;  // complex sums are sums of their parts
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

Decision view_as_real(const OpCall& call) {
  const auto& in = call.input(0);
  Space s = same_shape_space(call, in.shape(), {});
  s.add_dim(2, in.ndim(), false);
  s.lin = Lin::Sum;
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

}  // namespace

DTENSOR_RULES(rearrange_ops) {
  using dispatch::register_rule;
  register_rule("aten::repeat", repeat);
  register_rule("aten::roll", roll);
  register_rule("aten::flip", flip);
  register_rule({"aten::triu", "aten::tril"}, triangle);
  register_rule("aten::constant_pad_nd", constant_pad);
  register_rule("aten::view_as_complex", view_as_complex);
  register_rule("aten::view_as_real", view_as_real);
}

}  // namespace dtensor::ops
