#pragma once
// The contract every parallel style implements (torch.distributed.tensor.parallel.ParallelStyle).
// Users extend it for their own modules; parallelize_module() applies styles.
#include <torch/nn/module.h>

#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "dtensor/mesh/device_mesh.h"

namespace dtensor::tp {

class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;

  // The style's name and arguments as PyTorch would print them, for messages.
  virtual std::string repr() const = 0;

  // Throws (naming `fqn`, the style and the fix) when the style cannot be applied to
  // `module`. Called for every entry of a plan before anything is changed.
  virtual void validate(torch::nn::Module& module, const std::string& fqn,
                        const DeviceMesh& mesh) const {}

  // Shards the module's parameters and installs its hooks. `mesh` is 1-D.
  virtual void apply(torch::nn::Module& module, const std::string& fqn,
                     const DeviceMesh& mesh) const = 0;

  // Where parameters come from: a group rank to scatter/broadcast from, or none (every rank
  // keeps its own data, no communication). parallelize_module() sets it.
  std::optional<int64_t> src_data_rank = 0;
};

// A shared, type-erased style, so plans can be written with value syntax:
//   {{"net1", ColwiseParallel()}, {"net2", RowwiseParallel({.output_layouts = Shard(0)})}}
class Style {
 public:
  template <class S>
  requires std::derived_from<S, ParallelStyle>
  /* implicit */ Style(S style) : ptr_(std::make_shared<S>(std::move(style))) {}
  /* implicit */ Style(std::shared_ptr<ParallelStyle> style) : ptr_(std::move(style)) {}

  ParallelStyle& operator*() const { return *ptr_; }
  ParallelStyle* operator->() const { return ptr_.get(); }
  const std::shared_ptr<ParallelStyle>& ptr() const { return ptr_; }

 private:
  std::shared_ptr<ParallelStyle> ptr_;
};

}  // namespace dtensor::tp
