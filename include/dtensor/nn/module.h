#pragma once
// dtensor::nn::Module: the base for users' own modules, a torch::nn::Module whose forward runs
// forward hooks (tp::HookedModule), so parallel styles apply to it as to the built-in layers
// of dtensor/nn/layers.h. Its sources live in the tp layer, which owns the hooks.
#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "dtensor/core/distribute_module.h"
#include "dtensor/tp/module_hooks.h"

namespace dtensor::nn {

/// Base class for users' own modules: torch::nn::Module plus forward hooks.
class Module : public torch::nn::Module, public tp::HookedModule {
 public:
  /// torch::nn::Module's constructors.
  using torch::nn::Module::Module;

  /// Every parameter once, as PyTorch's parameters(): a tensor tied into two submodules
  /// (replace_parameter(*head, "weight", embedding->weight)) is listed once, so
  /// `torch::optim::Adam(model->parameters(), ...)` steps it once. These hide LibTorch's
  /// (non-virtual) versions, which list it under each name: through a `torch::nn::Module&`
  /// use dtensor::unique_parameters(). A submodule's own listing keeps its tied parameter
  /// (head->named_parameters(false) has "weight"), as in PyTorch.
  std::vector<at::Tensor> parameters(bool recurse = true) const {
    return unique_parameters(*this, recurse);
  }
  /// Each tensor under the first name LibTorch gives it (PyTorch's default remove_duplicate).
  torch::OrderedDict<std::string, at::Tensor> named_parameters(bool recurse = true) const {
    return unique_named_parameters(*this, recurse);
  }
};

}  // namespace dtensor::nn
