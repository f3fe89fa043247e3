// Softmax family: a softmax normalises over one dim, so that dim (and any pending sum, which is not
// linear through exp) is replicated; shards of the other dims pass through untouched.
#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

// `p` with Partial and Shard(dim) replaced by Replicate.
Placements replicate_dim(c10::ArrayRef<Placement> p, int64_t dim) {
  Placements out;
  for (const auto& x : p) out.push_back(x.is_partial() || x.is_shard(dim) ? Replicate() : x);
  return out;
}

// _softmax(self, dim, half_to_float), _log_softmax(...), _safe_softmax(self, dim, dtype)
Decision softmax(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const Placements p = replicate_dim(in.placements(), wrap_dim(call.int_arg(1), in.ndim()));
  return all_outputs(call, {p}, p);
}

// _safe_softmax's kernel has no meta version: same shape, the requested dtype or the input's.
Decision safe_softmax(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  Decision d = softmax(call);
  const auto dtype = call.arg(2).isNone() ? in.dtype() : call.arg(2).toScalarType();
  d.output_meta = {TensorMeta{in.shape(), strides_like(in.shape(), in.stride()), dtype}};
  return d;
}

// _softmax_backward_data(grad_output, output, dim, input_dtype) and the log variant: both
// tensors take the layout of the one with more shards (grad_output on a tie, as PyTorch).
Decision softmax_backward(const OpCall& call) {
  const DTensorSpec& grad = call.input(0);
  const DTensorSpec& out = call.input(1);
  const DTensorSpec& src = grad.num_shards() >= out.num_shards() ? grad : out;
  const Placements p = replicate_dim(src.placements(), wrap_dim(call.int_arg(2), src.ndim()));
  return all_outputs(call, {p, p}, p);
}

}  // namespace

DTENSOR_RULES(softmax_ops) {
  using dispatch::register_rule;
  register_rule("aten::_softmax", softmax);
  // Inside a LossParallel, tp's context rules make the log variants vocab-parallel
  // (docs/ARCHITECTURE.md, "Loss parallel").
  register_rule("aten::_log_softmax", softmax);
  register_rule("aten::_safe_softmax", safe_softmax);
  register_rule("aten::_softmax_backward_data", softmax_backward);
  register_rule("aten::_log_softmax_backward_data", softmax_backward);
}

}  // namespace dtensor::ops
