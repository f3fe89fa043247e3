#pragma once
// Settles the pending sums in parameter gradients before an optimizer step.
//
// SequenceParallel parameters (norm weights and biases) are Replicate, but their gradients are
// Partial: each rank holds its sequence shard's contribution. An optimizer that reads such a
// gradient has every op reduce it again (PyTorch's Adam: 3 all_reduces per parameter and step).
// reduce_partial_grads replaces each Partial gradient by its Replicate value once, coalescing
// gradients that share mesh, placements and dtype into one all_reduce:
//
//   loss.backward();
//   tp::reduce_partial_grads(*model);   // 1 all_reduce for all the norm gradients
//   optimizer.step();                   // no communication
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <vector>

namespace dtensor::tp {

/// Returns the number of gradients reduced. Plain and non-Partial gradients are left alone;
/// a parameter listed twice (tied weights) is reduced once.
int64_t reduce_partial_grads(const std::vector<at::Tensor>& params);
/// reduce_partial_grads(module.parameters()).
int64_t reduce_partial_grads(torch::nn::Module& module);

}  // namespace dtensor::tp
