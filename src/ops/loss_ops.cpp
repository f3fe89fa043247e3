// Negative log-likelihood losses without loss_parallel (cross_entropy reaches us as _log_softmax +
// nll_loss). The class dim of the input is replicated (class-sharded logits are gathered), the
// target follows the input's other dims and the class weights are replicated. A sharded batch
// leaves pending sums.
//
// "mean" differs from PyTorch on purpose: PyTorch averages the shards' means (Partial(avg)),
// which is only the batch mean when every shard has the same total weight — not so with class
// weights or ignored targets. Here each shard divides its sum by the total weight of the whole
// batch, and the result is an ordinary pending sum.
#include <ATen/core/Reduction.h>

#include "dtensor/ops/kernel_collectives.h"
#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

int64_t class_dim(const DTensorSpec& in) { return in.ndim() >= 2 ? 1 : 0; }

// The input's placements with the class dim and pending sums replicated.
Placements input_layout(const DTensorSpec& in) {
  const int64_t c = class_dim(in);
  Placements out;
  for (const auto& x : in.placements()) {
    out.push_back(x.is_partial() || x.is_shard(c) ? Replicate() : x);
  }
  return out;
}

// The target has the input's dims without the class dim.
Placements target_layout(c10::ArrayRef<Placement> input, int64_t c) {
  return remap_shards(input,
                      [c](int64_t d) -> std::optional<int64_t> { return d > c ? d - 1 : d; });
}

// The placements of a full reduction of a tensor laid out as `p`.
Placements reduce_all(c10::ArrayRef<Placement> p) {
  Placements out;
  for (const auto& x : p) out.push_back(x.is_shard() ? Partial() : x);
  return out;
}

bool has_shard(c10::ArrayRef<Placement> p) {
  return std::any_of(p.begin(), p.end(), [](const Placement& x) { return x.is_shard(); });
}

// nll_loss's total weight: the summed class weights (or count) of the targets not ignored.
at::Tensor total_weight_of(const at::Tensor& target, const at::Tensor& weight, int64_t ignore_index,
                           at::ScalarType dtype) {
  const at::Tensor keep = target.ne(ignore_index).flatten();
  if (!weight.defined()) return keep.sum().to(dtype);
  const at::Tensor w = weight.index_select(0, at::where(keep, target.flatten(), 0));
  return w.masked_fill(keep.logical_not(), 0).sum().to(dtype);
}

// A "mean" loss over a sharded batch: this shard's sum over the whole batch's total weight.
// A replicated target gives that total without communication (the target is cut to this
// shard here); a sharded one all-reduces the shards' totals (one scalar per sharding mesh dim).
dispatch::LocalKernel mean_over_shards(Placements target_p, bool target_replicated) {
  return [target_p, target_replicated](const c10::OperatorHandle& op, torch::jit::Stack& st,
                                       const dispatch::LocalContext& ctx) {
    // (self, target, weight?, reduction, ignore_index)
    const size_t base = st.size() - 5;
    const DeviceMesh& mesh = ctx.inputs[0]->mesh();
    at::Tensor target = st[base + 1].toTensor();
    const at::Tensor weight = st[base + 2].isNone() ? at::Tensor() : st[base + 2].toTensor();
    at::Tensor total;
    if (target_replicated) {
      total =
          total_weight_of(target, weight, st[base + 4].toInt(), st[base].toTensor().scalar_type());
      const auto shard = compute_local_shape_and_global_offset(target.sizes(), mesh.shape(),
                                                               *mesh.coordinate(), target_p);
      for (int64_t d = 0; d < target.dim(); ++d) {
        target = target.narrow(d, shard.offset[d], shard.shape[d]);
      }
      st[base + 1] = target;
    }
    st[base + 3] = static_cast<int64_t>(at::Reduction::Sum);
    op.callBoxed(st);
    if (!target_replicated) {
      std::vector<int64_t> sharded;
      for (size_t m = 0; m < target_p.size(); ++m) {
        if (target_p[m].is_shard()) sharded.push_back(static_cast<int64_t>(m));
      }
      total =
          kernel_all_reduce(op.schema().name(), st.back().toTensor(), ReduceOp::Sum, mesh, sharded);
    }
    st[st.size() - 2] = st[st.size() - 2].toTensor() / total;
    st.back() = total;
  };
}

// nll_loss_forward / nll_loss2d_forward(self, target, weight?, reduction, ignore_index)
//   -> (output, total_weight)
Decision nll_forward(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const DTensorSpec& target = call.input(1);
  const int64_t reduction = call.int_arg(3);
  const Placements in_p = input_layout(in);
  const Placements tg_p = target_layout(in_p, class_dim(in));
  const Placements rep = replicate_all(call.mesh_ndim());
  Decision d;
  d.inputs = {in_p, tg_p};
  if (call.num_inputs() > 2) d.inputs.push_back(rep);
  // nll_loss2d has no meta kernel.
  d.output_meta = {
      contiguous_meta(reduction == at::Reduction::None ? target.shape() : std::vector<int64_t>{},
                      in.dtype()),
      contiguous_meta({}, in.dtype())};
  if (reduction == at::Reduction::None) {
    d.outputs = {tg_p, rep};
  } else if (!has_shard(tg_p)) {
    d.outputs = {rep, rep};
  } else if (reduction == at::Reduction::Sum) {
    d.outputs = {reduce_all(tg_p), reduce_all(tg_p)};
  } else {
    const bool replicated = target.is_replicated();
    if (replicated) d.inputs[1] = rep;
    d.outputs = {reduce_all(tg_p), rep};
    d.local_kernel = mean_over_shards(tg_p, replicated);
  }
  return d;
}

// nll_loss_backward / nll_loss2d_backward(grad_output, self, target, weight?, reduction,
//                                         ignore_index, total_weight) -> grad_input
Decision nll_backward(const OpCall& call) {
  const DTensorSpec& in = call.input(input_of(call, 1));
  const int64_t reduction = call.int_arg(4);
  const Placements in_p = input_layout(in);
  const Placements tg_p = target_layout(in_p, class_dim(in));
  const Placements rep = replicate_all(call.mesh_ndim());
  Decision d;
  for (const auto& x : call.inputs()) {
    if (x.arg == 0) {
      d.inputs.push_back(reduction == at::Reduction::None ? tg_p : rep);  // grad_output
    } else if (x.arg == 1) {
      d.inputs.push_back(in_p);
    } else if (x.arg == 2) {
      d.inputs.push_back(tg_p);
    } else if (x.arg == 6) {
      // Only "mean" reads total_weight: leave it as it is otherwise (no needless all_reduce).
      d.inputs.push_back(reduction == at::Reduction::Mean ? rep : Placements{});
    } else {
      d.inputs.push_back(rep);  // class weights
    }
  }
  d.outputs = {in_p};
  d.output_meta = {contiguous_meta(in.shape(), in.dtype())};
  return d;
}

}  // namespace

DTENSOR_RULES(loss_ops) {
  using dispatch::register_rule;
  register_rule({"aten::nll_loss_forward", "aten::nll_loss2d_forward"}, nll_forward);
  register_rule({"aten::nll_loss_backward", "aten::nll_loss2d_backward"}, nll_backward);
}

}  // namespace dtensor::ops
