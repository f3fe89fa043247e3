#pragma once
// Meta kernels LibTorch lacks (meta_kernels.cpp registers them when the program is loaded).

namespace dtensor::plan {

// Does nothing: calling it keeps meta_kernels.cpp, and so its registrations, in a program
// linked against the static dtensor_plan_support.
void use_meta_kernels();

}  // namespace dtensor::plan
