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

/// Base of all parallel styles (PyTorch's ParallelStyle): how one module is parallelized.
class ParallelStyle {
 public:
  /// Virtual: styles are owned through Style's shared_ptr.
  virtual ~ParallelStyle() = default;

  /// The style's name and arguments as PyTorch prints them, e.g.
  /// "ColwiseParallel(input_layouts=(Replicate(),), output_layouts=(Shard(dim=-1),),
  /// use_local_output=True)". tp::parse_style() reads this form back.
  virtual std::string repr() const = 0;

  /// Throws (naming `fqn`, the module's type, the style and the fix) when the style cannot be
  /// applied to `module`. parallelize_module() calls it for every entry of a plan before it
  /// changes anything; apply() calls it too.
  virtual void validate(torch::nn::Module& /*module*/, const std::string& /*fqn*/,
                        const DeviceMesh& /*mesh*/) const {}

  /// Shards the module's parameters and installs its hooks. `mesh` is 1-D.
  virtual void apply(torch::nn::Module& module, const std::string& fqn,
                     const DeviceMesh& mesh) const = 0;

  /// True for styles that shard parameters through distribute_module (which may run only once
  /// per module), so parallelize_module() can refuse two of them on one module up front.
  virtual bool uses_distribute_module() const { return false; }

  /// Where parameters come from: a group rank to scatter/broadcast from, or none (every rank
  /// keeps its own data, no communication). parallelize_module() sets it, as PyTorch does.
  std::optional<int64_t> src_data_rank = 0;
};

/// A shared, type-erased style, so plans can be written with value syntax:
///   {{"net1", ColwiseParallel()}, {"net2", RowwiseParallel({.output_layouts = Shard(0)})}}
class Style {
 public:
  /// Wraps a copy of `style`.
  template <class S>
  requires std::derived_from<S, ParallelStyle>
  /* implicit */ Style(S style) : ptr_(std::make_shared<S>(std::move(style))) {}
  /// Shares `style`.
  template <class S>
  requires std::derived_from<S, ParallelStyle>
  /* implicit */ Style(std::shared_ptr<S> style) : ptr_(std::move(style)) {}

  ParallelStyle& operator*() const { return *ptr_; }        ///< The style.
  ParallelStyle* operator->() const { return ptr_.get(); }  ///< Member access to the style.
  const std::shared_ptr<ParallelStyle>& ptr() const { return ptr_; }  ///< The shared style.
  std::string repr() const { return ptr_->repr(); }                   ///< The style's repr().

 private:
  std::shared_ptr<ParallelStyle> ptr_;
};

}  // namespace dtensor::tp
