#pragma once
// Module tracking for CommDebugMode's per-module counts (PyTorch's ModTracker). One
// TrackedCall brackets each HookedModule forward call; it does nothing unless a CommDebugMode
// is active, so models pay nothing otherwise.
//
// Forward: the outermost call names the HookedModules under it by path (as tp::name_modules
// does) and every named call runs inside a ModuleScope. Backward: when grad mode is on, a
// gradient hook on each output tensor enters the module's backward region and hooks on the
// input tensors leave it once all their gradients are complete, so collectives issued in
// between (e.g. the all_reduce of a Colwise input's from_local) count for the module. Hooks
// change no values and add no autograd nodes.
#include <ATen/core/ivalue.h>

#include <optional>
#include <string>
#include <unordered_set>

#include "dtensor/comm/comm_debug_mode.h"

namespace dtensor::tp {

class HookedModule;
struct ModuleCall;

/// Tracks one HookedModule forward call for CommDebugMode; a no-op when none is active.
class TrackedCall {
 public:
  /// Before the forward pre-hooks: `call` holds the arguments as the caller passed them.
  TrackedCall(HookedModule& module, const ModuleCall& call);
  TrackedCall(const TrackedCall&) = delete;
  TrackedCall& operator=(const TrackedCall&) = delete;

  /// After the forward hooks, with the output the caller receives.
  void track_output(const c10::IValue& output) const;

 private:
  std::optional<ModuleScope> scope_;
  std::string fqn_;  // empty: untracked
  /// Inputs handed back unchanged as outputs (an identity Dropout) get no backward-entry hook:
  /// the module computed nothing there, and entering it would pop the module that did.
  std::unordered_set<const c10::TensorImpl*> inputs_;
};

}  // namespace dtensor::tp
