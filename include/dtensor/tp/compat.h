#pragma once
// The tensor-parallel API of PyTorch 2.0–2.1, for code written against it: PairwiseParallel and
// the make_input_* / make_output_* helpers that styles then took as _prepare_input /
// _prepare_output. PyTorch deprecated them for input_layouts / output_layouts (ColwiseParallel,
// RowwiseParallel, PrepareModuleInput/Output); new code should use those.
//
// The helpers work on one tensor over a 1-D mesh. Without a mesh they use the input's own
// (a plain input then has none: "device_mesh is not passed nor can be inferred"); an N-D mesh is
// refused ("device_mesh has dims 2 but expected to be 1 for input.").
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/tp/parallel_style.h"

namespace dtensor::tp {

/// Inputs: a plain tensor is taken as this rank's part with the given layout (from_local); a
/// DTensor is redistributed to it.
at::Tensor make_input_replicate_1d(const at::Tensor& input,
                                   const std::optional<DeviceMesh>& mesh = std::nullopt);
/// Shard(dim) input (PyTorch 2.0's make_input_shard_1d).
at::Tensor make_input_shard_1d(const at::Tensor& input,
                               const std::optional<DeviceMesh>& mesh = std::nullopt,
                               int64_t dim = 0);
/// make_input_shard_1d on the input's last dim.
at::Tensor make_input_shard_1d_last_dim(const at::Tensor& input,
                                        const std::optional<DeviceMesh>& mesh = std::nullopt);
/// A plain tensor taken as a Shard(0) part, then replicated (all-gathered).
at::Tensor make_input_reshard_replicate(const at::Tensor& input, const DeviceMesh& mesh);

/// Outputs (DTensors): redistributed to the layout; the *_tensor forms return the local tensor.
at::Tensor make_output_shard_1d(const at::Tensor& output,
                                const std::optional<DeviceMesh>& mesh = std::nullopt,
                                int64_t dim = 0);
/// Replicate output (PyTorch 2.0's make_output_replicate_1d).
at::Tensor make_output_replicate_1d(const at::Tensor& output,
                                    const std::optional<DeviceMesh>& mesh = std::nullopt);
/// Replicated, as a plain tensor.
at::Tensor make_output_tensor(const at::Tensor& output,
                              const std::optional<DeviceMesh>& mesh = std::nullopt);
/// The local shard as it is (no communication).
at::Tensor make_sharded_output_tensor(const at::Tensor& output,
                                      const std::optional<DeviceMesh>& mesh = std::nullopt);
/// Sharded on dim 0, as a plain tensor.
at::Tensor make_output_reshard_tensor(const at::Tensor& output,
                                      const std::optional<DeviceMesh>& mesh = std::nullopt);

/// Megatron's column/row pairing applied to a whole MLP (PyTorch 2.0's PairwiseParallel).
/// The rule, as PyTorch 2.0 applied it:
///   - A module with two or more direct torch::nn::LinearImpl children (in registration order;
///     e.g. Linear, activation, Linear) is an MLP. Its Linears are paired (1st, 2nd), (3rd, 4th),
///     ...: the first of each pair ColwiseParallel-sharded (weight and bias Shard(0)), the second
///     RowwiseParallel-sharded (weight Shard(1), bias Replicate); an odd last Linear is left as
///     it is. The first Linear's input goes through make_input_replicate_1d and the last paired
///     Linear's output through make_output_tensor, so the MLP takes and returns replicated plain
///     tensors; in between DTensors flow (one all_reduce per pair, when the Partial sum is used).
///   - Any other module: the rule is applied to each child in turn (a lone Linear is untouched).
/// The first and last paired Linears need hooks (dtensor::nn::Linear); validate() says so.
class PairwiseParallel : public ParallelStyle {
 public:
  /// No options: PairwiseParallel takes no arguments.
  PairwiseParallel() = default;
  std::string repr() const override { return "PairwiseParallel()"; }  ///< "PairwiseParallel()".
  /// Rejects MLPs whose first or last paired Linear cannot hold hooks.
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  /// Shards each MLP's Linear pairs as described above.
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
};

}  // namespace dtensor::tp
