#pragma once
// The rotary embedding both the model and the decoder apply (one definition, so generation
// rotates exactly as training did).
#include <ATen/ATen.h>

namespace dtensor::models::detail {

// x: (B, S, H, head_dim); cos, sin broadcastable to (B, S, H, head_dim / 2). Rotates consecutive
// pairs (x0, x1) as the complex number x0 + i x1 times cos + i sin (torchtitan's interleaved
// convention).
inline at::Tensor rotate_pairs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  auto pairs = x.unflatten(-1, {-1, 2});
  auto x0 = pairs.select(-1, 0);
  auto x1 = pairs.select(-1, 1);
  return at::stack({x0 * cos - x1 * sin, x0 * sin + x1 * cos}, -1).flatten(-2);
}

}  // namespace dtensor::models::detail
