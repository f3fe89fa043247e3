#pragma once
// The FLOPs the ATen ops of a simulated step perform, counted from their arguments' shapes as
// the ops run (as PyTorch's FlopCounterMode counts them): 2 per multiply-add of mm, addmm, bmm
// and baddbmm, and of the scaled-dot-product attention kernels (QK^T and AV, causal masking not
// subtracted; backward twice the forward). An op on DTensors is not counted itself: the local
// ops it runs on this rank's shards are; nor are the ops a counted op calls. Elementwise ops, norms
// and softmax are left out, as PyTorch leaves them out.
#include <ATen/record_function.h>

#include <atomic>

namespace dtensor::plan {

// Counts while alive (one at a time), on every thread (autograd's backward included).
class FlopCounter {
 public:
  FlopCounter();
  ~FlopCounter();
  FlopCounter(const FlopCounter&) = delete;
  FlopCounter& operator=(const FlopCounter&) = delete;

  double flops() const { return flops_.load(); }
  void reset() { flops_ = 0; }

  // FLOPs of one call of the ATen op `name` (e.g. "aten::mm") with these arguments; 0 for ops
  // not counted.
  static double flops_of(const char* name, c10::ArrayRef<const c10::IValue> inputs);

 private:
  static std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn);
  static void on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx);
  at::CallbackHandle handle_;
  std::atomic<double> flops_{0};
};

}  // namespace dtensor::plan
