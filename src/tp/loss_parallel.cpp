// loss_parallel: vocab-parallel log_softmax / nll_loss on class-sharded logits. Each rank holds a
// slice of the classes. Forward: a max and a sum of exp over the classes are all-reduced for
// log_softmax, and the target's log-probability (picked on the rank owning that class, zero
// elsewhere) is all-reduced for nll_loss: three all_reduces of N elements. Backward is fused into
// nll_loss_backward, which returns softmax - one_hot for the local classes (the whole gradient of
// the logits), so _log_softmax_backward_data passes it through and no rank needs another's classes.
// cross_entropy with label smoothing adds a term whose gradient needs the softmax correction: see
// loss_parallel_smoothing.cpp.
#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>

#include "dtensor/ops/kernel_collectives.h"
#include "dtensor/ops/layout_invariant.h"
#include "dtensor/ops/rule_utils.h"
#include "loss_parallel_rules.h"

namespace dtensor::tp::detail {
namespace {

using dispatch::Decision;
using dispatch::LocalContext;
using dispatch::OpCall;

int64_t class_dim(int64_t ndim) { return ndim >= 2 ? 1 : 0; }

// PyTorch's _find_all_reduce_mesh_dim: a 1-D mesh, sharded on `dim`.
void check_sharded_on(const DTensorSpec& in, int64_t dim) {
  TORCH_CHECK_VALUE(in.placements().size() == 1,
                    "Currently loss_parallel() only supports input on one-dimensional DeviceMesh.");
  TORCH_CHECK_VALUE(in.placements()[0].is_shard(dim),
                    "loss_parallel() should be enabled only when the input tensor is sharded on "
                    "dimension ",
                    dim, ".");
}

// The classes this rank holds: [offset, offset + size) along the class dim.
std::pair<int64_t, int64_t> local_classes(const DTensorSpec& in, int64_t c) {
  const LocalShard s = in.local_shard();
  return {s.offset[c], s.shape[c]};
}

// Per-target weight (class weight, 1 without weights), zero where the target is ignored.
at::Tensor target_weight(const at::Tensor& target, const at::Tensor& keep, const at::Tensor& weight,
                         const at::TensorOptions& opts) {
  if (!weight.defined()) return keep.to(opts.dtype());
  // The weight is replicated: index it with global ids (no need for its local chunk).
  const at::Tensor safe = target.masked_fill(keep.logical_not(), 0).flatten();
  return weight.index_select(0, safe)
      .view(target.sizes())
      .to(opts.dtype())
      .masked_fill(keep.logical_not(), 0);
}

// Local ids of the targets in this rank's classes, and which targets those are (ignored ones
// excluded: ignore_index may fall among the classes).
std::pair<at::Tensor, at::Tensor> local_targets(const at::Tensor& target, const at::Tensor& keep,
                                                int64_t offset, int64_t size) {
  const at::Tensor local = target - offset;
  const at::Tensor mine = local.ge(0).logical_and(local.lt(size)).logical_and(keep);
  return {local.masked_fill(mine.logical_not(), 0), mine};
}

}  // namespace

// _log_softmax(self, dim, half_to_float)
Decision log_softmax(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const int64_t dim = ops::wrap_dim(call.int_arg(1), in.ndim());
  check_sharded_on(in, dim);
  const bool to_float = call.bool_arg(2);
  Decision d;
  d.inputs = {in.placements()};
  d.outputs = {in.placements()};
  d.output_meta = {ops::contiguous_meta(in.shape(), to_float ? at::kFloat : in.dtype())};
  d.local_kernel = [dim](const c10::OperatorHandle& op, torch::jit::Stack& st,
                         const LocalContext& ctx) {
    const size_t base = st.size() - 3;
    at::Tensor x = st[base].toTensor();
    if (st[base + 2].toBool()) x = x.to(at::kFloat);
    const DeviceMesh& mesh = ctx.inputs[0]->mesh();
    std::vector<int64_t> row = x.sizes().vec();
    row[dim] = 1;
    // amax refuses an empty dim (more ranks than classes left this one none).
    at::Tensor max = x.size(dim) > 0
                         ? at::amax(x, dim, true)
                         : at::full(row, -std::numeric_limits<double>::infinity(), x.options());
    max = ops::kernel_all_reduce(op.schema().name(), max, ReduceOp::Max, mesh, 0);
    const at::Tensor shifted = x - max;
    // In LayoutInvariantMode the classes' sum is taken in the canonical order.
    const at::Tensor sum =
        ops::layout_invariant_segments() > 0
            ? ops::canonical_reduce(
                  shifted, dim, [dim](const at::Tensor& s) { return s.exp().sum(dim, true); },
                  &mesh, 0, op.schema().name())
            : ops::kernel_all_reduce(op.schema().name(), shifted.exp().sum(dim, true),
                                     ReduceOp::Sum, mesh, 0);
    torch::jit::drop(st, 3);
    st.emplace_back(shifted - sum.log());
  };
  return d;
}

// _log_softmax_backward_data(grad_output, output, dim, input_dtype): the incoming gradient is
// already the logits' gradient (see nll_backward); only its dtype changes.
Decision log_softmax_backward(const OpCall& call) {
  const DTensorSpec& grad = call.input(0);
  const at::ScalarType dtype = call.arg(3).toScalarType();
  Decision d;
  d.inputs = {Placements{}, Placements{}};
  d.outputs = {grad.placements()};
  d.output_meta = {ops::contiguous_meta(grad.shape(), dtype)};
  d.local_kernel = [](const c10::OperatorHandle&, torch::jit::Stack& st, const LocalContext&) {
    const at::Tensor g = st[st.size() - 4].toTensor();
    const at::ScalarType dt = st[st.size() - 1].toScalarType();
    torch::jit::drop(st, 4);
    st.emplace_back(g.to(dt));
  };
  return d;
}

// nll_loss_forward / nll_loss2d_forward(self, target, weight?, reduction, ignore_index)
//   -> (output, total_weight)
Decision nll_forward(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const int64_t c = class_dim(in.ndim());
  check_sharded_on(in, c);
  const int64_t reduction = call.int_arg(3);
  const Placements rep = replicate_all(call.mesh_ndim());
  Decision d;
  // The target and weights whole on every rank: the loss and total weight need no comm.
  d.inputs = {in.placements(), rep};
  if (call.num_inputs() > 2) d.inputs.push_back(rep);
  d.outputs = {rep, rep};
  const auto& target_shape = call.input(1).shape();
  d.output_meta = {
      ops::contiguous_meta(reduction == at::Reduction::None ? target_shape : std::vector<int64_t>{},
                           in.dtype()),
      ops::contiguous_meta({}, in.dtype())};
  d.local_kernel = [c](const c10::OperatorHandle& op, torch::jit::Stack& st,
                       const LocalContext& ctx) {
    const size_t base = st.size() - 5;
    const at::Tensor x = st[base].toTensor();
    // Targets arrive as plain tensors: on the logits' device (a no-op but for meta logits,
    // whose plain targets stay on the CPU so that the op reaches DTensor's kernel).
    const at::Tensor target = st[base + 1].toTensor().to(x.device());
    const at::Tensor weight = st[base + 2].isNone() ? at::Tensor() : st[base + 2].toTensor();
    const int64_t reduction = st[base + 3].toInt();
    const at::Tensor keep = target.ne(st[base + 4].toInt());
    const auto [offset, size] = local_classes(*ctx.inputs[0], c);
    const auto [local, mine] = local_targets(target, keep, offset, size);
    // Each target's log-probability lives on one rank; the others contribute zero.
    at::Tensor picked =
        size > 0 ? x.gather(c, local.unsqueeze(c)).squeeze(c).masked_fill(mine.logical_not(), 0)
                 : at::zeros(target.sizes(), x.options());
    picked =
        ops::kernel_all_reduce(op.schema().name(), picked, ReduceOp::Sum, ctx.inputs[0]->mesh(), 0);
    const at::Tensor w = target_weight(target, keep, weight, x.options());
    const at::Tensor loss = -picked * w;
    const at::Tensor total = w.sum();
    torch::jit::drop(st, 5);
    st.emplace_back(reduction == at::Reduction::None  ? loss
                    : reduction == at::Reduction::Sum ? loss.sum()
                                                      : loss.sum() / total);
    st.emplace_back(total);
  };
  return d;
}

// nll_loss_backward / nll_loss2d_backward(grad_output, self, target, weight?, reduction,
//   ignore_index, total_weight) -> grad_input. `self` is the vocab-parallel log_softmax output;
// the result is the gradient of the logits: (softmax - one_hot(target)) * weight * grad.
Decision nll_backward(const OpCall& call) {
  const int self = ops::input_of(call, 1);
  const DTensorSpec& in = call.input(self);
  const int64_t c = class_dim(in.ndim());
  check_sharded_on(in, c);
  const Placements rep = replicate_all(call.mesh_ndim());
  Decision d;
  for (const auto& x : call.inputs()) d.inputs.push_back(x.arg == 1 ? in.placements() : rep);
  d.outputs = {in.placements()};
  d.output_meta = {ops::contiguous_meta(in.shape(), in.dtype())};
  d.local_kernel = [c, self](const c10::OperatorHandle&, torch::jit::Stack& st,
                             const LocalContext& ctx) {
    const size_t base = st.size() - 7;
    const at::Tensor grad = st[base].toTensor();
    const at::Tensor logp = st[base + 1].toTensor();
    const at::Tensor target = st[base + 2].toTensor().to(logp.device());
    const at::Tensor weight = st[base + 3].isNone() ? at::Tensor() : st[base + 3].toTensor();
    const int64_t reduction = st[base + 4].toInt();
    const at::Tensor keep = target.ne(st[base + 5].toInt());
    const at::Tensor total = st[base + 6].toTensor();
    const auto [offset, size] = local_classes(*ctx.inputs[self], c);
    const auto [local, mine] = local_targets(target, keep, offset, size);
    at::Tensor factor = target_weight(target, keep, weight, logp.options()) * grad;
    if (reduction == at::Reduction::Mean) factor = factor / total;
    at::Tensor out = logp.exp();
    if (size > 0)
      out.scatter_add_(c, local.unsqueeze(c), mine.to(out.scalar_type()).neg().unsqueeze(c));
    torch::jit::drop(st, 7);
    st.emplace_back(out * factor.unsqueeze(c));
  };
  return d;
}

}  // namespace dtensor::tp::detail

namespace dtensor::tp {

// While a LossParallel is alive these replace the ordinary softmax and nll_loss rules.
DTENSOR_RULES(loss_parallel) {
  using dispatch::register_context_rule;
  register_context_rule("aten::_log_softmax", kLossParallelBit, detail::log_softmax);
  register_context_rule("aten::_log_softmax_backward_data", kLossParallelBit,
                        detail::log_softmax_backward);
  register_context_rule({"aten::nll_loss_forward", "aten::nll_loss2d_forward"}, kLossParallelBit,
                        detail::nll_forward);
  register_context_rule({"aten::nll_loss_backward", "aten::nll_loss2d_backward"}, kLossParallelBit,
                        detail::nll_backward);
}

}  // namespace dtensor::tp
