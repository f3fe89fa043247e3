#pragma once
// A rehearsal of CUDA graph capture that runs anywhere, CPU included: while a CaptureRehearsal
// is alive, every ATen op that would make the host wait for the device is recorded, with the
// module being run (forward or backward) — reading a value (item, _local_scalar_dense,
// is_nonzero, equal), an output whose size depends on the data (nonzero, masked_select, unique,
// repeat_interleave without an output size), a copy from a device to the host. Such an op
// cannot be captured (CUDA refuses it, or the graph freezes the value read at capture), so a
// step that passes the rehearsal on CPU has none of them. It observes ops through LibTorch's
// RecordFunction callbacks, on every thread (autograd's included), and counts the outermost such
// op only (item's own _local_scalar_dense is item's; _assert_async, which checks on the device
// under CUDA, is not reported for what its CPU kernel reads). See docs/ARCHITECTURE.md, "Capture
// rehearsal".
#include <ATen/record_function.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/comm/comm_debug_mode.h"

namespace dtensor::comm {

/// One op that would synchronise with the host.
struct HostSync {
  std::string op;      // "aten::item"
  std::string module;  // innermost tracked module ("" outside any)
  bool backward = false;
  std::string str() const;  // "aten::item in module 'layers.0.attention' (backward)"
};

/// Records host synchronisations while alive; one at a time. Module names come from the
/// module tracker, which it turns on (it holds a CommDebugMode: the collectives of the rehearsed
/// code are counted too, see comm_debug_mode()).
class CaptureRehearsal {
 public:
  CaptureRehearsal();
  ~CaptureRehearsal();
  CaptureRehearsal(const CaptureRehearsal&) = delete;
  CaptureRehearsal& operator=(const CaptureRehearsal&) = delete;

  /// Every host synchronisation so far, in order.
  std::vector<HostSync> syncs() const;
  /// Throws, naming the first op (and its module) and how many there were, if there was any.
  void check() const;
  /// The collectives counted while rehearsing.
  const CommDebugMode& comm_debug_mode() const { return comm_; }

 private:
  static std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn);
  static void on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx);

  CommDebugMode comm_;  // turns module tracking on
  mutable std::mutex mu_;
  std::vector<HostSync> syncs_;
  at::CallbackHandle handle_;
};

/// Runs `body` under a CaptureRehearsal and throws (naming the op) if it synchronised.
void rehearse_capture(const std::function<void()>& body);

}  // namespace dtensor::comm
