#pragma once
// The former place of clip_grad_norm_, which serves every layout, not FSDP's alone: it is
// dtensor::nn::utils::clip_grad_norm_ now (dtensor/nn/clip_grad.h). These names stay one release.
#include <ATen/core/Tensor.h>

#include <vector>

#include "dtensor/nn/clip_grad.h"

namespace dtensor::fsdp {

/// The former name of nn::utils::ClipGradNormOptions.
using ClipGradNormOptions [[deprecated("use dtensor::nn::utils::ClipGradNormOptions")]] =
    nn::utils::ClipGradNormOptions;

/// The former name of nn::utils::clip_grad_norm_.
[[deprecated("use dtensor::nn::utils::clip_grad_norm_ (dtensor/nn/clip_grad.h)")]] inline double
clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                const nn::utils::ClipGradNormOptions& options = {}) {
  return nn::utils::clip_grad_norm_(params, max_norm, options);
}

}  // namespace dtensor::fsdp
