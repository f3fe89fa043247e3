#pragma once
// Changing how a hook-capable module's body runs, without touching the module's code (activation
// checkpointing, dtensor/ac/checkpoint.h, is built on it).
//
// A forward wrapper runs in place of the body of a tp::HookedModule's forward: after its forward
// pre-hooks and before its forward hooks, call_forward hands the wrapper the call and the body,
// and the wrapper returns the output (usually by calling the body, around it whatever it adds).
// The body is valid only during that call. To run a module's body again later (on a saved call,
// without its hooks, wrapper or ancestor checks), call its forward while a BodyOnlyCall is alive.
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>

#include <functional>

#include "dtensor/tp/module_hooks.h"

namespace dtensor::tp {

/// A module's body: runs the forward's computation on a call (hooks excluded).
using ForwardBody = std::function<c10::IValue(const ModuleCall&)>;
/// Runs in place of the body; must return the body's output (or an equal one).
using ForwardWrapper = std::function<c10::IValue(torch::nn::Module& module, const ModuleCall& call,
                                                 const ForwardBody& body)>;

/// Sets `module`'s forward wrapper (replacing any); an empty wrapper removes it. The module must
/// be a HookedModule owned by a shared_ptr (any module holder's), so that a later module at the
/// same address does not inherit the wrapper.
void set_forward_wrapper(torch::nn::Module& module, ForwardWrapper wrapper);
/// Whether `module` has a forward wrapper.
bool has_forward_wrapper(const torch::nn::Module& module);

/// While alive, the next call_forward of `module` on this thread runs only its body, on `call`
/// (the arguments the caller passed to forward are ignored): no pre-hooks, wrapper or hooks, and
/// no check that its ancestors are running. The module is marked running for its submodules and
/// tracked for CommDebugMode as in a normal call.
class BodyOnlyCall {
 public:
  BodyOnlyCall(torch::nn::Module& module, const ModuleCall& call);
  ~BodyOnlyCall();
  BodyOnlyCall(const BodyOnlyCall&) = delete;
  BodyOnlyCall& operator=(const BodyOnlyCall&) = delete;

 private:
  const void* prev_module_;
  const ModuleCall* prev_call_;
};

}  // namespace dtensor::tp
