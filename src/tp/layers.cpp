#include "dtensor/nn/layers.h"

#include <ATen/ops/ones.h>
#include <ATen/ops/rms_norm.h>

namespace dtensor::nn {

RMSNormImpl::RMSNormImpl(RMSNormOptions options_) : options(options_) {
  if (options.elementwise_affine) weight = register_parameter("weight", at::ones({options.dim}));
}

void RMSNormImpl::reset_parameters() {
  if (weight.defined()) {
    at::NoGradGuard no_grad;
    weight.fill_(1.0);
  }
}

at::Tensor RMSNormImpl::forward(const at::Tensor& input) {
  return call_forward(
      [this](const at::Tensor& x) {
        return at::rms_norm(x, {options.dim},
                            weight.defined() ? std::optional(weight) : std::nullopt, options.eps);
      },
      input);
}

void RMSNormImpl::on_parameter_replaced(const std::string& name, const at::Tensor& value) {
  if (name == "weight") weight = value;
}

void RMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "dtensor::nn::RMSNorm(" << options.dim;
  if (options.eps) stream << ", eps=" << *options.eps;
  stream << ", elementwise_affine=" << (options.elementwise_affine ? "true" : "false") << ")";
}

}  // namespace dtensor::nn
