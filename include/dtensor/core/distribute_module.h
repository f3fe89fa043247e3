#pragma once
// distribute_module and the parameter swapping it rests on. torch::nn::Module keeps each
// parameter twice — in its registry and (for the standard layers) in a public member such as
// LinearImpl::weight — so both are replaced.
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/core/dtensor_impl.h"

namespace dtensor {

/// Replaces parameter `name` (a direct parameter of `module`) by `value`, in the registry and in
/// the public member of the standard layers (Linear, Embedding, LayerNorm, Conv1d/2d/3d,
/// BatchNorm, GroupNorm) and of modules that implement ParameterSwapTarget. `value` keeps the
/// old parameter's requires_grad.
void replace_parameter(torch::nn::Module& module, const std::string& name, at::Tensor value);
/// Like replace_parameter, for buffer `name`; throws when `module` has no such buffer.
void replace_buffer(torch::nn::Module& module, const std::string& name, at::Tensor value);

/// Parameters of `module` (and of its submodules when `recurse`) with each tensor listed once.
///
/// Tying one tensor into two modules — `replace_parameter(*head, "weight", embedding->weight)`,
/// as language models tie their output head to the embedding — leaves it registered in both,
/// and LibTorch's `torch::nn::Module::parameters()` then lists it twice: an optimizer built on
/// that list steps the tensor twice per step (and Adam's moments count it twice). PyTorch's
/// `parameters()` deduplicates; this does the same, by tensor identity (TensorImpl), keeping
/// LibTorch's order and the first occurrence.
///
/// `dtensor::nn::Module` (and so every model built on it) already lists parameters this way
/// through its own `parameters()` / `named_parameters()`; call these where a model is reached
/// through a plain `torch::nn::Module` (a `torch::nn::Sequential` root, a `torch::nn::Module&`).
std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module, bool recurse = true);

/// named_parameters() with each tensor listed once, under the first name LibTorch gives it (a
/// tied embedding/head weight appears as "embedding.weight" only), as PyTorch's
/// `named_parameters()` does by default. See unique_parameters().
torch::OrderedDict<std::string, at::Tensor> unique_named_parameters(const torch::nn::Module& module,
                                                                    bool recurse = true);

/// User modules that keep parameters in their own members implement this to hear about swaps.
class ParameterSwapTarget {
 public:
  /// Virtual, so that implementers can be destroyed through this interface.
  virtual ~ParameterSwapTarget() = default;
  /// Called after replace_parameter swapped parameter `name` for `value`.
  virtual void on_parameter_replaced(const std::string& name, const at::Tensor& value) = 0;
};

/// partition_fn of distribute_module: (submodule name, submodule, mesh); may shard parameters.
using PartitionFn =
    std::function<void(const std::string& name, torch::nn::Module& module, const DeviceMesh& mesh)>;

/// Calls partition_fn(name, submodule, mesh) for every submodule (root "" first), then
/// replicates every parameter and buffer that is not yet a DTensor (broadcast from group rank
/// `src_data_rank`; nullopt keeps each rank's values, without communication).
/// A module can be distributed only once.
void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const PartitionFn& partition_fn = nullptr,
                       std::optional<int64_t> src_data_rank = 0);

/// Whether distribute_module has been applied to `module` itself.
bool is_distributed_module(const torch::nn::Module& module);
/// Forgets that distribute_module was applied to `module`; for callers that restore the module's
/// original parameters after a failure (parallelize_module's rollback).
void forget_distributed_module(const torch::nn::Module& module);

}  // namespace dtensor
