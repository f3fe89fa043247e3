#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "dtensor/dispatch/cache.h"

namespace dtensor::dispatch {
void dtensor_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// The kernel of a CompositeImplicitAutograd op on our autograd key: runs LibTorch's decomposition
// (`ks` below autograd) and, when the decomposition reads the memory of a DTensor argument,
// which has none, fails naming the op and its DTensor inputs instead of LibTorch's bare
// "Cannot access data pointer of Tensor that doesn't have storage".
void composite_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                      torch::jit::Stack* stack);
}  // namespace dtensor::dispatch
