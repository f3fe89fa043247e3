#pragma once
// Comparing a parallelized model with its one-device reference: parameters by name, DTensors
// gathered whole, and a tolerance relative to the tensor's scale.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <map>
#include <string>

#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "support/distributed.h"

namespace dtensor::testing {

using Params = std::map<std::string, at::Tensor>;

// Every parameter by its path ("layers.0.attention.wq.weight").
inline Params params_of(const torch::nn::Module& m) {
  Params out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  return out;
}

// The whole value of a DTensor (gathered, detached); a plain tensor as it is.
inline at::Tensor whole(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t.detach()) : t; }

// What this rank holds of `full`, a one-device tensor, laid out like `p`: a DTensor's part
// (an FSDP leaf's rows of its tp-local part included), or all of it for a plain tensor.
inline at::Tensor part_like(const at::Tensor& p, const at::Tensor& full) {
  if (!is_dtensor(p)) return full;
  const LocalShard mine = spec_of(p).local_shard();
  at::Tensor part = full;
  for (int64_t d = 0; d < part.dim(); ++d) part = part.narrow(d, mine.offset[d], mine.shape[d]);
  return part;
}

// The local tensor of a DTensor; a plain tensor as it is.
inline at::Tensor local_of(const at::Tensor& t) { return is_dtensor(t) ? local_tensor(t) : t; }

// |a - b| <= tol * (|b| + max(max|b|, 1)): relative to the tensor's scale, so entries near
// zero (rounding noise in both) do not need digits they cannot have, and absolute below 1 as
// PyTorch's own float comparisons (Adam turns float32 rounding in gradients near its eps into
// parameter differences of a few 1e-6).
inline ::testing::AssertionResult close_to_scale(const at::Tensor& a, const at::Tensor& b,
                                                 double tol) {
  const double scale = std::max(b.abs().max().item<double>(), 1.0);
  return tensors_close(a.to(at::kDouble), b.to(at::kDouble), tol, tol * scale);
}

}  // namespace dtensor::testing
