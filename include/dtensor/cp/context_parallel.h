#pragma once
// Running a model context-parallel (PyTorch's context_parallel() context manager): while a
// ContextParallelScope lives on this thread, the decoder (dtensor/models/transformer.h) reads its
// rotary positions from the layout and runs its attention through context_attention, on the
// token slots of the layout this rank holds (docs/ARCHITECTURE.md, "Context parallelism").
//
//   cp::ContextLayout layout = cp::balanced_layout(document_ids, cp);  // same on every rank
//   cp::ContextParallelScope scope({layout, mesh.get_group("cp"), cp::RotateMethod::ring});
//   at::Tensor logits = model->forward(layout.shard(tokens, rank));     // (B, n, V)
//   loss.backward();  // inside the scope too: checkpointed blocks rerun their attention
#include <ATen/core/Tensor.h>

#include <memory>

#include "dtensor/comm/process_group.h"
#include "dtensor/cp/context_attention.h"
#include "dtensor/cp/context_layout.h"

namespace dtensor::cp {

/// What a model's attention needs to run context-parallel: the batch's layout, the cp group
/// (of layout.cp_size() ranks, this rank's group rank its part) and how keys and values travel.
struct ContextParallel {
  ContextLayout layout;
  std::shared_ptr<comm::ProcessGroup> group;
  RotateMethod rotate = RotateMethod::ring;

  /// This rank's part of the layout: its group rank.
  int64_t rank() const;
  /// (B, local_len) int64: the rotary positions of this rank's slots (layout.positions()'s).
  at::Tensor local_positions() const;
};

/// While alive, models on this thread run context-parallel with `context` (nested scopes: the
/// innermost). Keep it alive over the backward pass as well.
class ContextParallelScope {
 public:
  /// Fails when the group's size is not the layout's cp.
  explicit ContextParallelScope(ContextParallel context);
  ~ContextParallelScope();
  ContextParallelScope(const ContextParallelScope&) = delete;
  ContextParallelScope& operator=(const ContextParallelScope&) = delete;

  /// The innermost live scope's context on this thread; null outside every scope.
  static const ContextParallel* current();

 private:
  ContextParallel context_;
  const ContextParallel* previous_;
};

}  // namespace dtensor::cp
