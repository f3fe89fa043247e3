#pragma once
// Forward hooks for C++ modules (docs/ARCHITECTURE.md, "From parallelize_module to a collective").
// torch::nn::Module has neither hooks nor a virtual forward, so a module opts in by deriving from
// HookedModule and routing its forward through call_forward(). Parallel styles register hooks to
// convert inputs and outputs; the drop-in layers in dtensor/nn/layers.h and dtensor::nn::Module
// (for users' own modules) do the routing already.
//
//   struct BlockImpl : dtensor::nn::Module {
//     at::Tensor forward(const at::Tensor& x, const at::Tensor& freqs) {
//       return call_forward([&](const at::Tensor& x, const at::Tensor& freqs) { ... }, x, freqs);
//     }
//   };
//
// Hooks see a call as IValues (tensors, scalars, None, tuples), so they can convert any
// positional or keyword argument. Modules with keyword arguments take a tp::Kwargs and use
// call_forward_kw().
//
// Hooks that never run are an error, not a silent skip. A module's forward that does not go
// through call_forward cannot be intercepted (forward is not virtual), so the check is made
// one level down: when a hook-capable module runs, every hook-capable ancestor between it and
// the innermost ancestor that is running (or the top of the model, if none is) must itself be
// running; one with hooks that is not was bypassed, and the call throws, naming it.
// Ancestors are known once parallelize_module (or tp::name_modules) has seen the model. The
// check costs a walk up a few parent links per call. It needs a hook-capable module (the
// dtensor::nn layers, or a user's module that uses call_forward) under the bypassed one; a
// module with hooks over plain torch::nn modules only is not checked. Calling a submodule on
// its own while its ancestors have hooks is refused the same way; to do so on purpose, hold a
// DirectCallGuard.
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtensor::tp {

/// Keyword arguments of a call, as (name, value) pairs in call order.
using Kwargs = std::vector<std::pair<std::string, c10::IValue>>;

/// One forward call as hooks see it.
struct ModuleCall {
  std::vector<c10::IValue> args;  ///< Positional arguments.
  Kwargs kwargs;                  // in call order

  /// The keyword argument `name`, or nullptr when the call does not pass it.
  c10::IValue* kwarg(const std::string& name);
  /// Same, read-only.
  const c10::IValue* kwarg(const std::string& name) const;
};

/// May rewrite the call's arguments in place.
using ForwardPreHook = std::function<void(torch::nn::Module& module, ModuleCall& call)>;
/// May replace the output (a tuple IValue when the module returns several values).
using ForwardHook =
    std::function<void(torch::nn::Module& module, const ModuleCall& call, c10::IValue& output)>;

/// Mixin that gives a torch::nn::Module forward hooks (see the top of this file).
class HookedModule {
 public:
  /// No hooks, no name, no parent.
  HookedModule() = default;
  /// clone() copies hooks with the module; the parent link stays with the original's tree.
  HookedModule(const HookedModule& other)
      : pre_hooks_(other.pre_hooks_),
        hooks_(other.hooks_),
        next_handle_(other.next_handle_),
        fqn_(other.fqn_) {}
  /// Copies hooks, handles and name (not the parent link).
  HookedModule& operator=(const HookedModule& other);
  /// Virtual, so hooked modules can be destroyed through this base.
  virtual ~HookedModule() = default;

  /// Returns a handle for remove_hook.
  size_t register_forward_pre_hook(ForwardPreHook hook);
  /// Registers a hook run after forward; returns a handle for remove_hook.
  size_t register_forward_hook(ForwardHook hook);
  /// Removes the pre-hook or hook with `handle`; unknown handles are ignored.
  void remove_hook(size_t handle);
  /// Number of pre-hooks and hooks registered.
  size_t num_hooks() const { return pre_hooks_.size() + hooks_.size(); }
  /// The handle the next hook will get: handles only grow, so hooks registered after this call
  /// are exactly those with a handle at or above it.
  size_t next_hook_handle() const { return next_handle_; }

  /// The module's path from the root of its model ("layers.0.attention"), used to attribute
  /// collectives in CommDebugMode; set by parallelize_module and tp::name_modules().
  const std::string& fqn() const { return fqn_; }
  void set_fqn(std::string fqn) { fqn_ = std::move(fqn); }  ///< Sets fqn().

  /// The nearest hook-capable ancestor (set by tp::name_modules), or nullptr: unknown, or gone.
  HookedModule* hooked_parent() const;
  /// Sets hooked_parent(); remembers whether a parent owned by a shared_ptr is still alive.
  void set_hooked_parent(HookedModule* parent);

 protected:
  /// Runs pre-hooks, then body(args...) on the (possibly rewritten) arguments, then the
  /// forward hooks on its result. Arguments and result must convert to and from c10::IValue
  /// (at::Tensor, scalars, std::optional, std::tuple of those, std::vector<at::Tensor>).
  template <class Body, class... Args>
  auto call_forward(Body&& body, const Args&... args);

  /// The general form: body reads positional and keyword arguments from the call.
  c10::IValue call_forward_kw(const std::function<c10::IValue(const ModuleCall&)>& body,
                              ModuleCall call);

 private:
  torch::nn::Module& as_module();
  template <class Body, class Tuple, size_t... I>
  static auto invoke_unpacked(Body& body, const ModuleCall& call, std::index_sequence<I...>);

  /// Throws if a hook-capable ancestor with hooks was bypassed on the way to this call.
  void check_ancestors_ran();

  std::vector<std::pair<size_t, ForwardPreHook>> pre_hooks_;
  std::vector<std::pair<size_t, ForwardHook>> hooks_;
  size_t next_handle_ = 0;
  std::string fqn_;
  /// The parent's weak reference tells a live parent from a destroyed one (a parent not owned
  /// by a shared_ptr has none and is trusted by address, as the model owns its children).
  HookedModule* parent_ = nullptr;
  std::weak_ptr<torch::nn::Module> parent_owner_;
  bool parent_owned_ = false;
};

/// Names every HookedModule under `root` by its path (the root gets "") and links each to its
/// nearest hook-capable ancestor (the root keeps the link it has).
void name_modules(torch::nn::Module& root);

/// While alive, a hook-capable module may run although an ancestor with hooks is not running
/// (for calling a submodule of a parallelized model on its own, without its ancestors' hooks).
class DirectCallGuard {
 public:
  /// Allows direct calls on this thread; guards nest.
  DirectCallGuard();
  /// Ends this guard's allowance.
  ~DirectCallGuard();
  DirectCallGuard(const DirectCallGuard&) = delete;
  DirectCallGuard& operator=(const DirectCallGuard&) = delete;
};

// ---- implementation ----

template <class Body, class Tuple, size_t... I>
auto HookedModule::invoke_unpacked(Body& body, const ModuleCall& call, std::index_sequence<I...>) {
  return body(call.args[I].to<std::tuple_element_t<I, Tuple>>()...);
}

template <class Body, class... Args>
auto HookedModule::call_forward(Body&& body, const Args&... args) {
  using ArgTuple = std::tuple<std::decay_t<Args>...>;
  using Result = std::decay_t<decltype(body(args...))>;
  ModuleCall call;
  call.args.reserve(sizeof...(Args));
  (call.args.emplace_back(args), ...);
  c10::IValue out = call_forward_kw(
      [&](const ModuleCall& c) -> c10::IValue {
        TORCH_CHECK(c.args.size() == sizeof...(Args), "a forward pre-hook of ", as_module().name(),
                    " changed the number of positional arguments from ", sizeof...(Args), " to ",
                    c.args.size());
        return c10::IValue(
            invoke_unpacked<Body, ArgTuple>(body, c, std::index_sequence_for<Args...>{}));
      },
      std::move(call));
  return std::move(out).template to<Result>();
}

}  // namespace dtensor::tp
