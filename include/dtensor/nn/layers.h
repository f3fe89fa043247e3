#pragma once
// Hook-capable drop-in layers: dtensor::nn::Linear is a torch::nn::LinearImpl (same options,
// members and parameters) whose forward runs forward hooks, so parallel styles can convert its
// inputs and outputs as PyTorch's do. Swap the type, keep the code:
//
//   torch::nn::Linear fc{16, 32};   →   dtensor::nn::Linear fc{16, 32};
//
// dtensor::nn::Module (dtensor/nn/module.h) is the base for users' own modules.
// clone() of the standard layers returns the torch::nn type (without hooks).
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <optional>

#include "dtensor/core/distribute_module.h"
#include "dtensor/nn/module.h"
#include "dtensor/tp/module_hooks.h"

namespace dtensor::nn {

// Defines XImpl deriving from torch::nn::XImpl with a hooked single-input forward.
#define DTENSOR_HOOKED_LAYER(Name, ArgType)                                                  \
  class Name##Impl : public torch::nn::Name##Impl, public tp::HookedModule {                 \
   public:                                                                                   \
    using torch::nn::Name##Impl::Name##Impl;                                                 \
    at::Tensor forward(ArgType input) {                                                      \
      return call_forward(                                                                   \
          [this](const at::Tensor& x) { return torch::nn::Name##Impl::forward(x); }, input); \
    }                                                                                        \
  };                                                                                         \
  TORCH_MODULE(Name)

/// torch::nn::Linear with forward hooks (module holder dtensor::nn::Linear). Its forward is
/// at::linear, as Python's nn.Linear: LibTorch's C++ F::linear adds the bias of a 3-D input in a
/// second op, which in half precision rounds twice (a different result from Python's).
class LinearImpl : public torch::nn::LinearImpl, public tp::HookedModule {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& input);
};
TORCH_MODULE(Linear);
/// torch::nn::Embedding with forward hooks (module holder dtensor::nn::Embedding).
DTENSOR_HOOKED_LAYER(Embedding, const at::Tensor&);
/// torch::nn::LayerNorm with forward hooks (module holder dtensor::nn::LayerNorm).
DTENSOR_HOOKED_LAYER(LayerNorm, const at::Tensor&);
/// torch::nn::Dropout with forward hooks (module holder dtensor::nn::Dropout).
DTENSOR_HOOKED_LAYER(Dropout, at::Tensor);

#undef DTENSOR_HOOKED_LAYER

/// Options of RMSNorm (torch.nn.RMSNorm's arguments).
struct RMSNormOptions {
  /// Normalises over a last dimension of size `dim`.
  /* implicit */ RMSNormOptions(int64_t dim) : dim(dim) {}
  int64_t dim;                     ///< Size of the normalised (last) dimension.
  std::optional<double> eps;       // none: the dtype's machine epsilon, as torch.nn.RMSNorm
  bool elementwise_affine = true;  ///< Learn a per-element scale (`weight`, initialised to ones).
  /// The scale is weight_offset + weight (Gemma's norms: 1, weights stored around 0); see
  /// rms_norm() for the precision it is applied in.
  double weight_offset = 0;
  /// In half precision scale in float32 before rounding once, as with an offset (gpt-oss's
  /// norms); see rms_norm().
  bool scale_in_float32 = false;
};

/// at::rms_norm over the last `dim` elements scaled by weight_offset + weight (undefined: no
/// scale). In bfloat16 and float16 a plain norm is normalised in float32, rounded, then scaled,
/// as HF's Llama computes it; with a nonzero offset or `scale_in_float32` the norm and the scale
/// are applied in float32 before rounding once, as Gemma and gpt-oss compute them.
at::Tensor rms_norm(const at::Tensor& input, int64_t dim, const at::Tensor& weight,
                    std::optional<double> eps, double weight_offset = 0,
                    bool scale_in_float32 = false);

/// Root-mean-square norm over the last dimension (torch.nn.RMSNorm, which LibTorch's C++ API
/// lacks), computed with at::rms_norm.
class RMSNormImpl : public Module, public ParameterSwapTarget {
 public:
  /// Registers `weight` (ones; 1 - weight_offset with an offset) when options.elementwise_affine.
  explicit RMSNormImpl(RMSNormOptions options);
  /// Normalises `input` over its last dimension, running forward hooks.
  at::Tensor forward(const at::Tensor& input);
  /// Sets `weight` back to ones (a scale of one with the offset).
  void reset_parameters();
  /// Keeps the `weight` member in step when parameter "weight" is swapped.
  void on_parameter_replaced(const std::string& name, const at::Tensor& value) override;
  /// Prints "dtensor::nn::RMSNorm(dim, eps=..., elementwise_affine=...)".
  void pretty_print(std::ostream& stream) const override;

  RMSNormOptions options;  ///< The options the module was built with.
  at::Tensor weight;       // undefined without elementwise_affine
};
/// Module holder of RMSNormImpl (as TORCH_MODULE defines for the torch layers).
TORCH_MODULE(RMSNorm);

}  // namespace dtensor::nn
