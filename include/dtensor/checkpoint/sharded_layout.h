#pragma once
// Tensors that hold one rank's part of a larger global tensor without being DTensors (the
// parameter shards of fsdp::fully_shard, and the optimizer state laid out like them). A layer
// above checkpoint registers a resolver that recognizes them; save_checkpoint then writes their
// global tensors under the parameters' names and load_checkpoint hands each rank its part, so
// a checkpoint moves between any sharded layouts and one device.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace dtensor::checkpoint {

/// How the parameter a resolver recognized maps to its global tensor.
struct ShardedLayout {
  std::vector<int64_t> global_shape;  ///< Shape of the global tensor in the checkpoint.
  /// Collective over the ranks that share the parameter: the global tensor of `local`, a tensor
  /// shaped like the parameter (the parameter itself or its optimizer state).
  std::function<at::Tensor(const at::Tensor& local)> gather;
  /// This rank's part of `global`, shaped like the parameter (no communication).
  std::function<at::Tensor(const at::Tensor& global)> part;
};

/// nullopt for tensors the resolver does not know.
using ShardedLayoutResolver = std::function<std::optional<ShardedLayout>(const at::Tensor& param)>;

/// Adds a resolver (idempotent per caller: register once, e.g. under std::call_once).
void register_sharded_layout(ShardedLayoutResolver resolver);

/// The layout of `param` from the first resolver that knows it; nullopt for plain tensors and
/// DTensors.
std::optional<ShardedLayout> sharded_layout_of(const at::Tensor& param);

}  // namespace dtensor::checkpoint
