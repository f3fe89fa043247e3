#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "dtensor/dispatch/cache.h"

namespace dtensor::dispatch {
void dtensor_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);
}
