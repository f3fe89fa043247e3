#pragma once
// The gradient of a DTensor leaf is a DTensor, also where a derivative formula builds it as a
// plain tensor (docs/ARCHITECTURE.md, "Autograd above the wrapper").
#include <ATen/core/Tensor.h>

namespace dtensor::dispatch {

/// For a DTensor leaf that requires grad, while grad mode is on: installs (once, first among
/// its hooks) the tensor hook that turns a plain gradient arriving at it into a DTensor laid
/// out as the leaf. The kernel calls it for every DTensor input that requires grad, so every
/// leaf an op records in the graph has the hook before backward reaches it.
void watch_leaf_gradient(const at::Tensor& dtensor);

}  // namespace dtensor::dispatch
