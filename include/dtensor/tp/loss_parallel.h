#pragma once
// Vocab-parallel cross entropy (PyTorch's loss_parallel()). While a LossParallel lives on this
// thread, log_softmax / nll_loss on logits that are a DTensor sharded on the class dim of a 1-D
// mesh are computed without gathering the classes: forward costs three all_reduces of N elements
// (N = product of the non-class dims), backward none. The loss is Replicate and the logits'
// gradient stays Shard(class).
//
//   {
//     dtensor::tp::LossParallel lp;
//     auto loss = F::cross_entropy(logits, target);  // logits: Shard(1); target: any tensor
//     loss.backward();                               // keep the guard alive here too
//   }
//
// Like PyTorch: logits sharded on another dim, or on a 2-D mesh, raise an error naming
// loss_parallel; a log_softmax not consumed by nll_loss gets an identity backward.
// The target (and class weights) are used whole on every rank: plain tensors count as
// Replicate inside the guard (as PyTorch wraps them), DTensors are redistributed to Replicate.
// Label smoothing is supported (unlike PyTorch, whose smoothing term's gradient skips the
// softmax correction): cross_entropy_loss on DTensor logits with label_smoothing > 0 is taken
// over inside the guard, and its smoothing term costs one more all_reduce of N elements
// forward, none backward (src/tp/loss_parallel_smoothing.cpp).
#include <ATen/core/Reduction.h>
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dtensor/dispatch/implicit_replication.h"
#include "dtensor/dispatch/op_call.h"

namespace dtensor::tp {

/// The decision-context bit LossParallel sets (see dispatch::decision_context()).
inline constexpr int64_t kLossParallelBit = int64_t{1} << 0;

/// Guard enabling vocab-parallel log_softmax / nll_loss on this thread (see above).
class LossParallel {
 public:
  /// Sets kLossParallelBit and treats plain tensors as Replicate until destruction.
  LossParallel() : guard_(kLossParallelBit) {}

 private:
  dispatch::DecisionContextGuard guard_;
  ImplicitReplication plain_targets_;  // a plain target tensor joins as Replicate
};

/// Mean cross entropy over every position of `logits` (..., V), a DTensor sharded on the class
/// (last) dim of a 1-D mesh, against int64 `targets` (...) (a plain tensor or a DTensor, used
/// whole): LossParallel's computation wrapped in an autograd function whose backward re-enters
/// LossParallel, so loss.backward() needs no guard. Returns a plain 0-d tensor, equal on every
/// rank. `reduction` as at::cross_entropy_loss's (at::Reduction::Mean or Sum); targets of -100
/// are ignored either way.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t reduction = at::Reduction::Mean);

/// Whether a LossParallel is alive on this thread.
inline bool loss_parallel_enabled() {
  return (dispatch::decision_context() & kLossParallelBit) != 0;
}

}  // namespace dtensor::tp
