#pragma once
// The collectives DTensor uses, on local tensors of one process group. Out-of-place,
// counted by CommDebugMode, failing with the rank, group and collective on error or timeout.
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "dtensor/comm/process_group.h"
#include "dtensor/comm/reduce_op.h"

namespace dtensor::comm {

/// A collective in flight. wait() returns the finished result (applying any post-processing
/// such as unpadding) and is idempotent.
class PendingResult {
 public:
  /// An empty result: ready(), and wait() returns an undefined tensor.
  PendingResult() = default;
  /// Wraps `work` writing into `buffer`; `finish` (may be empty) post-processes it; `what` names it
  /// in errors. Built by the *_async collectives.
  PendingResult(c10::intrusive_ptr<c10d::Work> work, at::Tensor buffer,
                std::function<at::Tensor(at::Tensor)> finish, std::string what);
  /// A result with no collective behind it (a transition that needs no communication, or a
  /// group of one rank): ready(), wait() returns `value`, then() applies its step at once.
  static PendingResult completed(at::Tensor value) {
    return PendingResult({}, std::move(value), nullptr, "");
  }
  /// True once wait() has run (or when default-constructed); does not poll the collective.
  bool ready() const { return !work_; }
  /// Blocks until the collective completes, then returns the result; throws naming the collective
  /// on failure or timeout. Later calls return the same tensor.
  at::Tensor wait();
  /// Chains one more local step to run after the collective completes.
  void then(std::function<at::Tensor(at::Tensor)> f);

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor buffer_;
  std::function<at::Tensor(at::Tensor)> finish_;
  std::string what_;
};

/// Sum/avg/max/min/product over the group.
at::Tensor all_reduce(const at::Tensor& t, ReduceOp op, ProcessGroup& pg);
/// Asynchronous all_reduce; call wait() on the result.
PendingResult all_reduce_async(const at::Tensor& t, ReduceOp op, ProcessGroup& pg);

/// Concatenates every rank's `t` along `dim` (all inputs must have the same shape).
at::Tensor all_gather_into_tensor(const at::Tensor& t, int64_t dim, ProcessGroup& pg);
/// Asynchronous all_gather_into_tensor; call wait() on the result.
PendingResult all_gather_into_tensor_async(const at::Tensor& t, int64_t dim, ProcessGroup& pg);

/// Reduces `t` over the group and returns this rank's chunk along `dim`
/// (t.size(dim) must be divisible by the group size).
at::Tensor reduce_scatter_tensor(const at::Tensor& t, int64_t dim, ReduceOp op, ProcessGroup& pg);
/// Asynchronous reduce_scatter_tensor; call wait() on the result.
PendingResult reduce_scatter_tensor_async(const at::Tensor& t, int64_t dim, ReduceOp op,
                                          ProcessGroup& pg);

/// Splits `t` evenly along `split_dim`, sends chunk i to rank i, concatenates what it receives
/// along `concat_dim`.
at::Tensor all_to_all_single(const at::Tensor& t, int64_t split_dim, int64_t concat_dim,
                             ProcessGroup& pg);

/// Uneven all-to-all along dim 0 (PyTorch's all_to_all_single with split sizes): this rank's
/// rows of `t` go in consecutive blocks of input_split_sizes[i] rows to group rank i; it receives
/// output_split_sizes[i] rows from rank i, concatenated in rank order. Every rank's input split
/// for rank j must equal rank j's output split for it (exchange the counts first).
at::Tensor all_to_all_single(const at::Tensor& t, const std::vector<int64_t>& output_split_sizes,
                             const std::vector<int64_t>& input_split_sizes, ProcessGroup& pg);

/// Returns group rank `src`'s tensor on every rank (others pass a tensor of the same shape).
at::Tensor broadcast(const at::Tensor& t, int src, ProcessGroup& pg);

/// Group rank `src` passes one tensor per rank (all the same shape); every rank receives its own.
at::Tensor scatter(const std::vector<at::Tensor>& chunks_on_src, const at::Tensor& like, int src,
                   ProcessGroup& pg);

// ---- point-to-point ----
// A send and its receive meet by (sender, receiver, tag): messages with the same tag between
// the same two ranks are received in the order they were sent. Unlike the collectives above,
// only the two ranks take part; each direction between two ranks numbers its messages on its
// own channel ("<group>:0->1"), which errors and DTENSOR_CHECK_COLLECTIVES diagnoses name.

/// Posts sending `t` to group rank `dst` of `pg` and returns at once (a pipeline's
/// send-then-receive must not deadlock); wait() returns once the message left and `t` may be
/// reused. Fails, as the collectives do, on a timeout or when another rank reports a failure.
PendingResult isend(const at::Tensor& t, int dst, ProcessGroup& pg, int tag = 0);
/// Posts receiving a tensor of `like`'s shape, dtype and device from group rank `src`; wait()
/// returns the received tensor (a fresh one).
PendingResult irecv(const at::Tensor& like, int src, ProcessGroup& pg, int tag = 0);
/// isend(...).wait().
void send(const at::Tensor& t, int dst, ProcessGroup& pg, int tag = 0);
/// irecv(...).wait().
at::Tensor recv(const at::Tensor& like, int src, ProcessGroup& pg, int tag = 0);

}  // namespace dtensor::comm
