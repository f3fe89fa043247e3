#pragma once
// A census of the ATen ops a piece of code makes the device run, by name: while an OpCensus is
// alive, every operator called on plain tensors is counted, on every thread (autograd's
// included), except what a counted op calls (its own work: addmm's resolve_conj), an op with a
// DTensor argument (its work is the local ops its kernel runs on the shards, which are counted)
// and an op that decomposes above autograd (CompositeImplicitAutograd: linear, cross_entropy;
// on DTensors it never reaches our kernel, so it counts as its pieces everywhere). A plain
// LibTorch step and the same step on DTensors so compare op for op. Observed through LibTorch's
// RecordFunction callbacks (as dtensor_plan's FLOP counter); work the dispatcher hides from
// profilers (its shape inference) and the autograd engine's own ranges are not counted.
#include <ATen/record_function.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace dtensor::dispatch {

/// Counts leaf ops by name while alive; one at a time.
class OpCensus {
 public:
  OpCensus();
  ~OpCensus();
  OpCensus(const OpCensus&) = delete;
  OpCensus& operator=(const OpCensus&) = delete;

  /// Ops counted so far, by name ("aten::mm").
  std::map<std::string, int64_t> counts() const;
  /// Their sum.
  int64_t total() const;

 private:
  static std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn);
  static void on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx);

  mutable std::mutex mu_;
  std::map<std::string, int64_t> counts_;
  at::CallbackHandle handle_;
};

}  // namespace dtensor::dispatch
