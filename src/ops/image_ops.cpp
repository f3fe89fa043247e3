// Ops on (N, C, spatial...) images (docs/ARCHITECTURE.md, "Images: interpolation, grid
// sampling, channel shuffle"): each sample and each channel is computed alone, so shards of the
// batch and channel dims stay, as in PyTorch; spatial dims, which an interpolation reads across,
// are replicated.
#include "dtensor/ops/rule_utils.h"
#include "reduction_layout.h"

namespace dtensor::ops {
namespace {

// The layout an image op runs on: batch shards stay, and channel shards where no rank's share
// is empty (the kernels refuse an image without channels, and that rank alone would refuse).
Placements batch_and_channels(const DTensorSpec& in) {
  const std::vector<bool> channels = keepable_shards(in, 1, {.nonempty = true});
  Placements out;
  for (size_t i = 0; i < in.placements().size(); ++i) {
    const Placement& x = in.placements()[i];
    out.push_back(x.is_shard(0) || (x.is_shard(1) && channels[i]) ? x : Replicate());
  }
  return out;
}

// upsample_*(self, output_size, ...): output_size names spatial dims only, the same locally.
Decision upsample(const OpCall& call) {
  const Placements p = batch_and_channels(call.input(0));
  return all_outputs(call, {p}, p);
}

// upsample_*_backward(grad_output, output_size, input_size, ...): input_size is the global
// (N, C, spatial...) size, rewritten to this rank's.
Decision upsample_backward(const OpCall& call) {
  const Placements p = batch_and_channels(call.input(0));
  Decision d = all_outputs(call, {p}, p);
  d.local_args.push_back({2, c10::IValue(local_shape_of(call.mesh(), call.int_list_arg(2), p))});
  return d;
}

// channel_shuffle(self, groups): mixes channels; batch and spatial shards stay.
Decision channel_shuffle(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const Placements p = keep_shards(in.placements(), [](int64_t d) { return d != 1; });
  Decision d = all_outputs(call, {p}, p);
  d.output_meta = {contiguous_meta(in.shape(), in.dtype())};  // no meta kernel
  return d;
}

// Keeps candidates whose `input`'s channel shards are all non-empty (see batch_and_channels).
StrategyFilter channels_nonempty(const OpCall& call, size_t input) {
  return [&call, input](const Strategy& s) {
    const DTensorSpec& in = call.input(input);
    const DTensorSpec candidate(in.mesh(), s.inputs[input], in.meta());
    const std::vector<bool> ok = keepable_shards(candidate, 1, {.nonempty = true});
    for (size_t i = 0; i < ok.size(); ++i) {
      if (s.inputs[input][i].is_shard(1) && !ok[i]) return false;
    }
    return true;
  };
}

// grid_sampler_2d/3d(input, grid, ...) -> output (N, C, out spatial...). Per mesh dim, in
// PyTorch's order: all replicated; the batch split over input, grid and output; the channels
// split over input and output with the grid whole.
Decision grid_sampler(const OpCall& call) {
  const std::vector<DimStrategy> choices = {{Replicate(), Replicate(), Replicate()},
                                            {Shard(0), Shard(0), Shard(0)},
                                            {Shard(1), Shard(1), Replicate()}};
  Decision d = dispatch::choose(call, expand_to_mesh(call, choices, 1, channels_nonempty(call, 0)));
  // No meta kernel: the output is (N, C) of the input by the grid's spatial sizes.
  const auto& in = call.input(0).shape();
  const auto& grid = call.input(1).shape();
  std::vector<int64_t> shape{in[0], in[1]};
  shape.insert(shape.end(), grid.begin() + 1, grid.end() - 1);
  d.output_meta = {contiguous_meta(shape, call.input(0).dtype())};
  return d;
}

// grid_sampler_2d/3d_backward(grad_output, input, grid, ..., output_mask) -> (grad_input,
// grad_grid): with the channels split each rank's grid gradient is its channels' share, a sum.
Decision grid_sampler_backward(const OpCall& call) {
  const std::vector<DimStrategy> choices = {
      {Replicate(), Replicate(), Replicate(), Replicate(), Replicate()},
      {Shard(0), Shard(0), Shard(0), Shard(0), Shard(0)},
      {Shard(1), Partial(), Shard(1), Shard(1), Replicate()}};
  Decision d = dispatch::choose(call, expand_to_mesh(call, choices, 2, channels_nonempty(call, 1)));
  d.output_meta = {call.input(1).meta(), call.input(2).meta()};
  for (auto& m : d.output_meta) m = contiguous_meta(m->shape, m->dtype);
  return d;
}

}  // namespace

DTENSOR_RULES(image_ops) {
  using dispatch::register_rule;
  register_rule(
      {"aten::upsample_nearest1d", "aten::upsample_nearest2d", "aten::upsample_nearest3d",
       "aten::_upsample_nearest_exact1d", "aten::_upsample_nearest_exact2d",
       "aten::_upsample_nearest_exact3d", "aten::upsample_linear1d", "aten::upsample_bilinear2d",
       "aten::upsample_bicubic2d", "aten::upsample_trilinear3d", "aten::_upsample_bilinear2d_aa",
       "aten::_upsample_bicubic2d_aa"},
      upsample);
  register_rule(
      {"aten::upsample_nearest1d_backward", "aten::upsample_nearest2d_backward",
       "aten::upsample_nearest3d_backward", "aten::_upsample_nearest_exact1d_backward",
       "aten::_upsample_nearest_exact2d_backward", "aten::_upsample_nearest_exact3d_backward",
       "aten::upsample_linear1d_backward", "aten::upsample_bilinear2d_backward",
       "aten::upsample_bicubic2d_backward", "aten::upsample_trilinear3d_backward",
       "aten::_upsample_bilinear2d_aa_backward", "aten::_upsample_bicubic2d_aa_backward"},
      upsample_backward);
  register_rule({"aten::channel_shuffle", "aten::native_channel_shuffle"}, channel_shuffle);
  register_rule({"aten::grid_sampler_2d", "aten::grid_sampler_3d"}, grid_sampler);
  register_rule({"aten::grid_sampler_2d_backward", "aten::grid_sampler_3d_backward"},
                grid_sampler_backward);
}

}  // namespace dtensor::ops
