#pragma once
// clip_grad_norm_ for the parameters of any layout the library composes (models/parallelize.h),
// in torch.nn.utils' place (PyTorch's clip_grad_norm_ takes DTensor and FSDP2 gradients too);
// implemented by the fsdp layer, the lowest that knows every layout (src/fsdp/clip_grad_norm.cpp):
// FSDP's leaves (DTensors over "dp", or (tp, dp) for TP's parameters), TP's DTensors, plain
// tensors, and the stages of a pipeline, each rank holding its own. Like
// torch::nn::utils::clip_grad_norm_ (the 2-norm of all gradients together; each gradient scaled
// by max_norm / (norm + 1e-6) when that is below 1), with every element of the global gradients
// counted exactly once: with FSDP, each gradient's squares are summed over the mesh dims its
// placements shard it over; without, DTensor gradients go through LibTorch's clip_grad_norm_ (a
// pending p-norm, one all_reduce for the sharded ones); the stages' squares are summed over the
// pp group.
//
// Collectives per call: with FSDP, one all_reduce per group some gradient is sharded over (the
// dp group, and the tp group where TP shards some parameters over more than one rank); DTensor
// gradients without FSDP, what LibTorch's clip_grad_norm_ issues on them; with a stage group,
// one all_reduce on it.
//
// In ops::LayoutInvariantMode(P) every layout takes one canonical sum instead: each gradient is
// cut into a fixed grid of blocks (dim 0 into 2P, a matrix's last dim into P: the splits of TP
// degrees dividing P and of FSDP over at most 2 ranks inside TP's), each block's squares summed
// alone in float64, the blocks exchanged with one all_gather per group a gradient is sharded
// over, then added in a fixed tree per gradient and in order over the gradients (with a stage
// group, the stages' per-gradient sums are all-gathered over it - two all_gathers instead of the
// all_reduce - and added in stage order, the whole model's order when each stage holds a run of
// its parameters): the same norm, bit for bit, at TP 1, 2, 4, dp_shard 1, 2 and pp 1, 2. A
// gradient whose sizes do not divide into the grid is refused, naming its shape.
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "dtensor/comm/process_group.h"

namespace dtensor::nn::utils {

/// Options of clip_grad_norm_.
struct ClipGradNormOptions {
  /// Pipeline parallelism: the group whose ranks hold the other stages (the "pp" group); their
  /// squared norms are summed over it. nullptr: the parameters are the whole model.
  std::shared_ptr<comm::ProcessGroup> stage_group;
  /// Parameters whose gradients are scaled but not counted: a copy whose gradient another
  /// stage counts (the last stage's copy of a tied embedding).
  std::function<bool(const at::Tensor& param)> counted_elsewhere;
};

/// Scales the gradients of `params` in place so that their global 2-norm is at most
/// `max_norm` (infinity: never), and returns the global norm before scaling (equal on every
/// rank). Parameters without a gradient are skipped.
double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                       const ClipGradNormOptions& options = {});

/// clip_grad_norm_ without reading anything back to the host (as PyTorch's Python function,
/// which returns a tensor): the norm is a 0-d tensor on the gradients' device (plain, equal on
/// every rank; float64, or the gradients' dtype on LibTorch's one-mesh path) and the gradients
/// are scaled by min(1, max_norm / (norm + 1e-6)) computed there, so a step using it can be
/// captured in a CUDA graph. The same values and collectives as clip_grad_norm_, which is this
/// function followed by item(). One exception reads the host: the layout-invariant mode with a
/// stage group (pipelines are not captured).
at::Tensor clip_grad_norm_on_device_(const std::vector<at::Tensor>& params, double max_norm,
                                     const ClipGradNormOptions& options = {});

}  // namespace dtensor::nn::utils
