#pragma once
// Residual dropout (GPT-2's resid_pdrop, Megatron-LM's hidden_dropout): a decoder block's
// attention and feed-forward outputs are dropped out before they join the residual stream. The
// mask of an element depends only on where it sits in the step's global batch (row, position,
// feature), the block and the site, under a DropoutKey: every layout draws the same mask for the
// same element - TP ranks (which hold whole activations without sequence parallelism), FSDP's and
// data parallelism's ranks and batch segments, pipeline stages and their micro-batches - and a
// recomputation (activation checkpointing) draws it again.
//
//   {
//     models::DropoutKeyScope key({.seed = step_seed, .first_row = dp_rank * rows,
//                                  .global_rows = batch});
//     loss_and_backward(model->forward(tokens), targets);  // backward's recomputations too
//   }
//
// Without a key (a plain forward), the mask is a fresh draw of the library's random stream
// (dtensor/core/random.h) over the local batch. Blocks drop out only in training mode.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace dtensor::models {

/// Where this thread's batch sits in the step's global batch, and the step's key.
struct DropoutKey {
  uint64_t seed = 0;        ///< The step's key (e.g. from the run's seed and the step number).
  int64_t first_row = 0;    ///< The global batch row of the local batch's first row.
  int64_t global_rows = 0;  ///< Rows of the global batch.
};

/// Keys residual dropout on this thread while it lives; the previous key comes back after.
class DropoutKeyScope {
 public:
  explicit DropoutKeyScope(const DropoutKey& key);
  ~DropoutKeyScope();
  DropoutKeyScope(const DropoutKeyScope&) = delete;
  DropoutKeyScope& operator=(const DropoutKeyScope&) = delete;
  /// The local batch now starts at global row `first_row` (a pipeline's next micro-batch).
  void set_first_row(int64_t first_row);

 private:
  std::optional<DropoutKey> previous_;
};

/// `x` (B, S, D; a plain tensor) with each element kept with probability 1 - p and scaled by
/// 1 / (1 - p), else 0, as site `site` (0: attention, 1: feed-forward) of block `layer` draws it.
at::Tensor residual_dropout(const at::Tensor& x, double p, int64_t layer, int64_t site);

}  // namespace dtensor::models
