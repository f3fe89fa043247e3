#pragma once
// distribute_module and the parameter swapping it rests on. torch::nn::Module keeps each
// parameter twice — in its registry and (for the standard layers) in a public member such as
// LinearImpl::weight — so both are replaced.
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "dtensor/core/dtensor_impl.h"

namespace dtensor {

// Replaces parameter `name` (a direct parameter of `module`) by `value`, in the registry and in
// the public member of the standard layers (Linear, Embedding, LayerNorm, Conv1d/2d/3d,
// BatchNorm, GroupNorm) and of modules that implement ParameterSwapTarget. `value` keeps the
// old parameter's requires_grad.
void replace_parameter(torch::nn::Module& module, const std::string& name, at::Tensor value);
void replace_buffer(torch::nn::Module& module, const std::string& name, at::Tensor value);

// User modules that keep parameters in their own members implement this to hear about swaps.
class ParameterSwapTarget {
 public:
  virtual ~ParameterSwapTarget() = default;
  virtual void on_parameter_replaced(const std::string& name, const at::Tensor& value) = 0;
};

using PartitionFn =
    std::function<void(const std::string& name, torch::nn::Module& module, const DeviceMesh& mesh)>;

// Calls partition_fn(name, submodule, mesh) for every submodule (root "" first), then
// replicates every parameter and buffer that is not yet a DTensor (broadcast from group rank
// `src_data_rank`; nullopt keeps each rank's values, without communication).
// A module can be distributed only once.
void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const PartitionFn& partition_fn = nullptr,
                       std::optional<int64_t> src_data_rank = 0);

// Whether distribute_module has been applied to `module` itself.
bool is_distributed_module(const torch::nn::Module& module);
// Forgets that distribute_module was applied to `module`; for callers that restore the module's
// original parameters after a failure (parallelize_module's rollback).
void forget_distributed_module(const torch::nn::Module& module);

}  // namespace dtensor
