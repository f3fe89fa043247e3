#pragma once
// YaRN rotary scaling (Hugging Face rope_type "yarn", gpt-oss): the rotary frequencies blended
// between the original ones (high frequencies, kept) and ones slowed by `factor` (low
// frequencies, interpolated) over a linear ramp of dimensions set by beta_fast and beta_slow, and
// cos and sin scaled by an attention factor (0.1 ln(factor) + 1 unless given).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace dtensor::models {

struct YarnRopeScaling {
  double factor = 1;
  double beta_fast = 32;
  double beta_slow = 1;
  int64_t original_max_position_embeddings = 4096;
  bool truncate = true;                    // round the ramp's ends outwards to whole dimensions
  std::optional<double> attention_factor;  // unset: from factor (and mscale, mscale_all_dim)
  double mscale = 0;
  double mscale_all_dim = 0;
};

/// The head_dim / 2 rotary frequencies for base `theta`, in float64, as transformers'
/// _compute_yarn_parameters computes them (in float32 there).
at::Tensor yarn_inverse_frequencies(int64_t head_dim, double theta, const YarnRopeScaling& s);

/// The factor cos and sin are multiplied by.
double yarn_attention_factor(const YarnRopeScaling& s);

}  // namespace dtensor::models
