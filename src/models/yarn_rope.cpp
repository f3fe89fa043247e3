// YaRN rotary scaling (yarn_rope.h).
#include "dtensor/models/yarn_rope.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace dtensor::models {

namespace {

double mscale_of(double factor, double mscale) {
  return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

}  // namespace

double yarn_attention_factor(const YarnRopeScaling& s) {
  if (s.attention_factor) return *s.attention_factor;
  if (s.mscale != 0 && s.mscale_all_dim != 0)
    return mscale_of(s.factor, s.mscale) / mscale_of(s.factor, s.mscale_all_dim);
  return mscale_of(s.factor, 1.0);
}

at::Tensor yarn_inverse_frequencies(int64_t head_dim, double theta, const YarnRopeScaling& s) {
  TORCH_CHECK(s.factor > 0 && s.original_max_position_embeddings > 0 && theta > 0,
              "YaRN rope scaling needs a positive factor, original_max_position_embeddings and "
              "rope_theta");
  const double dim = static_cast<double>(head_dim);
  // The dimension whose wavelength turns `rotations` times over the original context.
  auto correction_dim = [&](double rotations) {
    return dim *
           std::log(static_cast<double>(s.original_max_position_embeddings) /
                    (rotations * 2 * M_PI)) /
           (2 * std::log(theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // as transformers: no division by zero
  const at::Tensor pos = at::pow(theta, at::arange(0, head_dim, 2, at::kDouble) / dim);
  const at::Tensor ramp =
      ((at::arange(head_dim / 2, at::kDouble) - low) / (high - low)).clamp(0, 1);
  // 1 keeps a dimension's own frequency (extrapolation), 0 slows it by factor (interpolation).
  const at::Tensor keep = 1 - ramp;
  return (1.0 / (s.factor * pos)) * (1 - keep) + (1.0 / pos) * keep;
}

}  // namespace dtensor::models
