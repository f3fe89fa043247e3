#pragma once
// fully_shard: data-parallel sharding of a module's parameters over a 1-D "dp" mesh (PyTorch's
// FSDP2). Each parameter is replaced by a leaf, a DTensor sharded Shard(0) over "dp" whose local
// tensor holds this dp rank's rows (torch.chunk split); the optimizer steps those leaves. Each
// forward of the unit issues one all-gather of all its shards (one flat buffer) and runs on the
// gathered parameters; the backward of that gather is one reduce-scatter that averages the
// gradients over dp into the leaves' grads, after which the gathered parameters are freed.
//
// With reshard_after_forward the gathered parameters' storage is freed (resized to 0 bytes; the
// tensors autograd saved stay, empty) when the unit's forward returns, and gathered again into
// the same storage by one all-gather when the first gradient reaches the unit's outputs, before
// the unit's backward runs: per unit and step 2 all-gathers and 1 reduce-scatter, instead of 1
// and 1, for parameters that are whole only while their unit runs.
//
// Activation checkpointing composes in either order (torchtitan applies it first): the
// recompute runs on the gathered parameters the forward used (gathered again first, with
// reshard_after_forward), and adds no collective.
//
// Tensor parallelism composes when applied first, on a (dp, tp) mesh: a DTensor parameter's
// tp-local tensor is what is sharded over dp (shard_info counts its rows), and the gathered
// local tensor is wrapped back into a DTensor with the parameter's spec for the module, whose
// backward moves the gradient to the parameter's placements (a Partial gradient is summed
// over tp) before the reduce-scatter over dp. Its leaf is a 2-D DTensor on the mesh
// (tp, dp) = DeviceMesh::concatenate({mesh["tp"], mesh["dp"]}) with placements (TP's, Shard(0)):
// mesh dims shard in order, each the local tensor left by the ones before, which is exactly
// FSDP's rows of the tp-local tensor (PyTorch's FSDP2 puts dp first and needs _StridedShard).
// Being DTensors, the leaves need nothing FSDP-specific elsewhere: full_tensor() gives the
// global value, checkpoints save and load them and their optimizer state like any DTensor, and
// nn::utils::clip_grad_norm_ counts each element once from the placements.
//
//   for (auto& block : *model->layers) fsdp::fully_shard(*block, dp_mesh);
//   fsdp::fully_shard(*model, dp_mesh);   // the root last: it takes the parameters left over
//   torch::optim::AdamW opt(model->parameters(), ...);   // after fully_shard: the leaves
//
//   apply_tensor_parallel(*model, mesh["tp"]);  then fully_shard each block and the root on
//   mesh["dp"] as above
//
// Checkpoints (dtensor/checkpoint/checkpoint.h) save each leaf and its optimizer state whole
// under the parameter's name and load each rank's rows, so a checkpoint moves between any
// (dp, tp) layouts and one device.
//
// Limitations: DTensor parameters must live on a 1-D mesh sliced, like the dp mesh, from one
// mesh; tied parameters are refused; the
// unit's backward must start from its outputs (a gathered parameter that leaves
// the unit other than through its outputs is not gathered again for backward).
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>

#include "dtensor/comm/process_group.h"
#include "dtensor/core/dtensor_spec.h"
#include "dtensor/mesh/device_mesh.h"

namespace dtensor::fsdp {

/// Options of fully_shard.
struct FullyShardOptions {
  /// Free the gathered parameters after the unit's forward and gather them again before its
  /// backward (less memory, one more all-gather); false keeps them until backward.
  bool reshard_after_forward = false;
  /// Mixed precision (PyTorch FSDP2's MixedPrecisionPolicy): the dtype the parameters are
  /// all-gathered in and the unit computes in (e.g. at::kBFloat16; the unit's floating-point
  /// arguments are cast to it). The shards, their .grad and the optimizer state keep the
  /// parameters' dtype. nullopt: the parameters' dtype.
  std::optional<at::ScalarType> param_dtype;
  /// The dtype the gradients are reduce-scattered in; the result lands on the shards' .grad in
  /// the shards' dtype. nullopt: the gradients' own dtype (param_dtype when that is set).
  std::optional<at::ScalarType> reduce_dtype;
  /// Overlap the all-gathers with compute: the unit's forward starts the all-gather of the unit
  /// whose forward came next in the previous forward call (so from the second call on), and
  /// its backward starts the regather of the unit whose backward comes next (with
  /// reshard_after_forward). The same collectives, in the same order on every rank, and the
  /// same values; at most two units' parameters are gathered at once.
  bool prefetch = true;
};

/// Shards the parameters of `unit` not already owned by a fully_shard'ed submodule over the
/// 1-D mesh `dp_mesh`. `unit` must be hook-capable (a dtensor::nn::Module or dtensor::nn layer).
void fully_shard(torch::nn::Module& unit, const DeviceMesh& dp_mesh,
                 FullyShardOptions options = {});

/// PyTorch FSDP2's set_requires_gradient_sync, for `module`'s units (fully_shard'ed at or
/// below it); returns how many. Off, a unit's backward adds its unsharded gradients to a local
/// sum instead of reduce-scattering them (the shards' .grad stay as they are), and the unit
/// keeps its all-gathered parameters: later forwards and regathers reuse them, without an
/// all-gather, while the shards are unchanged (their versions: an optimizer step invalidates
/// them). Back on, the next backward adds the local sum and reduce-scatters once, and frees the
/// kept parameters. Gradient accumulation over M micro-batches (a pipeline schedule turns sync
/// off for all but each stage's last backward) then costs each unit 1 all-gather and 1
/// reduce-scatter per step, instead of M of each (2M all-gathers with reshard_after_forward).
/// Memory: the unit's gathered parameters and a gradient buffer of that size stay while off.
int64_t set_requires_gradient_sync(torch::nn::Module& module, bool requires_gradient_sync);

/// Whether `param` is a sharded leaf created by fully_shard.
bool is_fsdp_shard(const at::Tensor& param);

/// The sharding of a leaf from fully_shard: the full dim-0 size, this rank's first row, the
/// group its rows are split over and, for a parameter TP had made a DTensor, that DTensor's
/// spec (the leaf holds rows of its local tensor).
struct ShardInfo {
  int64_t full_rows = 0;   ///< Size of dim 0 of the unsharded (tp-local) parameter.
  int64_t row_offset = 0;  ///< First row of the unsharded parameter this rank holds.
  std::shared_ptr<comm::ProcessGroup> dp_group;  ///< The "dp" group of its unit.
  std::shared_ptr<const DTensorSpec> tp_spec;    ///< nullptr: a plain parameter.
};
/// The sharding of `param` (throws when it is not from fully_shard).
ShardInfo shard_info(const at::Tensor& param);

}  // namespace dtensor::fsdp
