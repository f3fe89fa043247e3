// Layer norm, fused RMS norm and group norm. Statistics are taken over the trailing normalised
// dims, so those dims (and pending sums) are replicated while shards of the outer dims (batch,
// sequence) are kept. The weight and bias gradients sum over the outer dims: a shard there leaves a
// pending sum, which is why sequence-parallel norm weights get Partial gradients with no
// communication.
#include <ATen/OpMathType.h>

#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

// Placements of a tensor normalised over dims >= axis.
Placements keep_outer(c10::ArrayRef<Placement> p, int64_t axis) {
  Placements out;
  for (const auto& x : p) {
    out.push_back(x.is_partial() || (x.is_shard() && x.dim() >= axis) ? Replicate() : x);
  }
  return out;
}

// A sum over the outer dims of a tensor laid out as `p` (outer shards or Replicate only).
Placements sum_outer(c10::ArrayRef<Placement> p) {
  Placements out;
  for (const auto& x : p) out.push_back(x.is_shard() ? Partial() : x);
  return out;
}

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
// _fused_rms_norm(input, normalized_shape, weight?, eps?) -> (out, rstd)
Decision norm_forward(const OpCall& call, bool rms) {
  const DTensorSpec& in = call.input(0);
  const int64_t axis = in.ndim() - static_cast<int64_t>(call.int_list_arg(1).size());
  const Placements p = keep_outer(in.placements(), axis);
  std::vector<Placements> inputs{p};
  for (size_t j = 1; j < call.num_inputs(); ++j) inputs.push_back(replicate_all(call.mesh_ndim()));
  Decision d = all_outputs(call, std::move(inputs), p);
  // Neither op has a C++ meta kernel. The statistics keep the outer dims (size 1 elsewhere);
  // for half/bfloat16 inputs they are float, except in the CPU layer norm kernel, which keeps
  // the input's dtype unless the parameters are float.
  std::vector<int64_t> stats(in.shape().begin(), in.shape().begin() + axis);
  stats.resize(in.shape().size(), 1);
  at::ScalarType stats_dtype = at::toOpMathType(in.dtype());
  if (!rms && call.mesh().device_type() == c10::kCPU) {
    bool float_params = false;
    for (size_t j = 1; j < call.num_inputs(); ++j) {
      float_params |= call.input(j).dtype() != in.dtype();
    }
    if (!float_params) stats_dtype = in.dtype();
  }
  d.output_meta = {contiguous_meta(in.shape(), in.dtype())};
  for (int r = 1; r < (rms ? 2 : 3); ++r) {
    d.output_meta.push_back(contiguous_meta(stats, stats_dtype));
  }
  return d;
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?, bias?,
//                            output_mask[3]) -> (grad_input, grad_weight, grad_bias)
// _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight?, output_mask[2])
//                          -> (grad_input, grad_weight)
Decision norm_backward(const OpCall& call, bool rms) {
  const DTensorSpec& in = call.input(input_of(call, 1));
  const int64_t axis = in.ndim() - static_cast<int64_t>(call.int_list_arg(2).size());
  const Placements p = keep_outer(in.placements(), axis);
  const int weight_arg = rms ? 4 : 5;
  const auto mask = call.arg(rms ? 5 : 7).toBoolList();
  Decision d;
  for (const auto& x : call.inputs()) {
    // grad_out and the saved statistics follow the input; weight and bias are replicated.
    d.inputs.push_back(x.arg >= weight_arg ? replicate_all(call.mesh_ndim()) : p);
  }
  d.outputs.push_back(mask[0] ? std::optional<Placements>(p) : std::nullopt);
  d.output_meta.push_back(contiguous_meta(in.shape(), in.dtype()));
  // Kernels only build the parameter gradients they are asked for; a missing parameter has none.
  for (int r = 1; r < static_cast<int>(call.num_returns()); ++r) {
    const int param = input_of(call, weight_arg + r - 1);
    if (mask[r] && param >= 0) {
      d.outputs.push_back(sum_outer(p));
      const DTensorSpec& w = call.input(param);
      d.output_meta.push_back(contiguous_meta(w.shape(), w.dtype()));
    } else {
      d.outputs.push_back(std::nullopt);
      d.output_meta.push_back(std::nullopt);
    }
  }
  return d;
}

// Group norm normalises each sample's groups of channels: only batch shards stay. The kernels
// take the batch size N as an argument, rewritten to this rank's rows.
Placements batch_only(c10::ArrayRef<Placement> p) {
  return keep_shards(p, [](int64_t d) { return d == 0; });
}

// native_group_norm(input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean, rstd); the
// statistics are (N, group).
Decision group_norm_forward(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const Placements p = batch_only(in.placements());
  std::vector<Placements> inputs{p};
  for (size_t j = 1; j < call.num_inputs(); ++j) inputs.push_back(replicate_all(call.mesh_ndim()));
  Decision d = all_outputs(call, std::move(inputs), p);
  d.local_args.push_back({3, local_shape_of(call.mesh(), in.shape(), p)[0]});
  // No meta kernel: the statistics are (N, group) in the input's dtype (CPU).
  const std::vector<int64_t> stats{in.shape()[0], call.int_arg(6)};
  d.output_meta = {contiguous_meta(in.shape(), in.dtype()), contiguous_meta(stats, in.dtype()),
                   contiguous_meta(stats, in.dtype())};
  return d;
}

// native_group_norm_backward(grad_out, input, mean, rstd, weight?, N, C, HxW, group,
//                            output_mask[3]) -> (grad_input, grad_weight, grad_bias): the
// parameter gradients sum over the batch, pending where it is sharded.
Decision group_norm_backward(const OpCall& call) {
  const DTensorSpec& in = call.input(input_of(call, 1));
  const Placements p = batch_only(in.placements());
  const auto mask = call.arg(9).toBoolList();
  Decision d;
  for (const auto& x : call.inputs()) {
    d.inputs.push_back(x.arg == 4 ? replicate_all(call.mesh_ndim()) : p);
  }
  for (int r = 0; r < 3; ++r) {
    if (!mask[r]) {
      d.outputs.push_back(std::nullopt);
    } else {
      d.outputs.push_back(r == 0 ? p : sum_outer(p));
    }
  }
  d.local_args.push_back({5, local_shape_of(call.mesh(), in.shape(), p)[0]});
  const std::vector<int64_t> channels{call.int_arg(6)};
  d.output_meta = {contiguous_meta(in.shape(), in.dtype()), contiguous_meta(channels, in.dtype()),
                   contiguous_meta(channels, in.dtype())};
  return d;
}

}  // namespace

DTENSOR_RULES(norm_ops) {
  using dispatch::register_rule;
  register_rule("aten::native_layer_norm", [](const OpCall& c) { return norm_forward(c, false); });
  register_rule("aten::native_layer_norm_backward",
                [](const OpCall& c) { return norm_backward(c, false); });
  // Reached on CUDA only: on CPU at::rms_norm decomposes into pow/mean/rsqrt/mul above us.
  register_rule("aten::_fused_rms_norm", [](const OpCall& c) { return norm_forward(c, true); });
  register_rule("aten::_fused_rms_norm_backward",
                [](const OpCall& c) { return norm_backward(c, true); });
  register_rule("aten::native_group_norm", group_norm_forward);
  register_rule("aten::native_group_norm_backward", group_norm_backward);
}

}  // namespace dtensor::ops
