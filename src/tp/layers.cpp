#include "dtensor/nn/layers.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/full.h>
#include <ATen/ops/rms_norm.h>

namespace dtensor::nn {

RMSNormImpl::RMSNormImpl(RMSNormOptions options_) : options(options_) {
  if (options.elementwise_affine)
    weight = register_parameter("weight", at::full({options.dim}, 1.0 - options.weight_offset));
}

void RMSNormImpl::reset_parameters() {
  if (weight.defined()) {
    at::NoGradGuard no_grad;
    weight.fill_(1.0 - options.weight_offset);
  }
}

at::Tensor rms_norm(const at::Tensor& x, int64_t dim, const at::Tensor& weight,
                    std::optional<double> eps, double weight_offset) {
  if (!weight.defined() || weight_offset == 0)
    return at::rms_norm(x, {dim}, weight.defined() ? std::optional(weight) : std::nullopt, eps);
  // Half precision is normalised and scaled in float32 and rounded once, at the end.
  const bool narrow = at::isReducedFloatingType(x.scalar_type());
  const at::Tensor scale = (narrow ? weight.to(at::kFloat) : weight) + weight_offset;
  const at::Tensor out = at::rms_norm(narrow ? x.to(at::kFloat) : x, {dim}, scale, eps);
  return narrow ? out.to(x.scalar_type()) : out;
}

at::Tensor RMSNormImpl::forward(const at::Tensor& input) {
  return call_forward(
      [this](const at::Tensor& x) {
        return rms_norm(x, options.dim, weight, options.eps, options.weight_offset);
      },
      input);
}

void RMSNormImpl::on_parameter_replaced(const std::string& name, const at::Tensor& value) {
  if (name == "weight") weight = value;
}

void RMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "dtensor::nn::RMSNorm(" << options.dim;
  if (options.eps) stream << ", eps=" << *options.eps;
  if (options.weight_offset != 0) stream << ", weight_offset=" << options.weight_offset;
  stream << ", elementwise_affine=" << (options.elementwise_affine ? "true" : "false") << ")";
}

}  // namespace dtensor::nn
