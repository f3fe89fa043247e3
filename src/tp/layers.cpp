#include "dtensor/nn/layers.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rms_norm.h>

namespace dtensor::nn {

at::Tensor LinearImpl::forward(const at::Tensor& input) {
  return call_forward(
      [this](const at::Tensor& x) {
        return at::linear(x, weight, bias.defined() ? std::optional(bias) : std::nullopt);
      },
      input);
}

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
                    std::optional<double> eps, double weight_offset, bool scale_in_float32) {
  const bool narrow = at::isReducedFloatingType(x.scalar_type());
  if (!weight.defined()) return at::rms_norm(x, {dim}, std::nullopt, eps);
  if (weight_offset == 0 && !scale_in_float32) {
    // Half precision is normalised in float32, rounded, then scaled (HF's LlamaRMSNorm and its
    // kin); LibTorch's fused kernel would scale before rounding, a different bit in a quarter of
    // the elements.
    if (narrow) return at::rms_norm(x, {dim}, std::nullopt, eps) * weight;
    return at::rms_norm(x, {dim}, weight, eps);
  }
  // With an offset (Gemma), or asked (gpt-oss), half precision is normalised and scaled in
  // float32 and rounded once.
  const at::Tensor scale = (narrow ? weight.to(at::kFloat) : weight) + weight_offset;
  const at::Tensor out = at::rms_norm(narrow ? x.to(at::kFloat) : x, {dim}, scale, eps);
  return narrow ? out.to(x.scalar_type()) : out;
}

at::Tensor RMSNormImpl::forward(const at::Tensor& input) {
  return call_forward(
      [this](const at::Tensor& x) {
        return rms_norm(x, options.dim, weight, options.eps, options.weight_offset,
                        options.scale_in_float32);
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
