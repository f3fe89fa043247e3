#include "dtensor/tp/module_tracker.h"

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <memory>

#include "dtensor/tp/module_hooks.h"

namespace dtensor::tp {
namespace {

// Tensors that can carry a gradient hook: non-leaf (a hook on a leaf would outlive the
// graph) and requiring grad.
template <class F>
void for_each_hookable(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.requires_grad() && !t.is_leaf()) f(t);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) for_each_hookable(e, f);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) for_each_hookable(e, f);
  }
}

// Leaves the module's backward region once every hooked input has its gradient.
struct InputGradState {
  std::string fqn;
  int expected = 0;
  int seen = 0;
  int task = -1;
};

}  // namespace

TrackedCall::TrackedCall(HookedModule& module, const ModuleCall& call) {
  if (!CommDebugMode::any_active()) return;
  if (ModuleScope::empty()) {
    // The outermost call names its subtree, so names follow the model being run even when
    // parallelize_module named a submodule from itself.
    if (auto* root = dynamic_cast<torch::nn::Module*>(&module)) {
      const std::string& prefix = module.fqn();
      for (const auto& item : root->named_modules("", /*include_self=*/false))
        if (auto* hooked = dynamic_cast<HookedModule*>(item.value().get()))
          hooked->set_fqn(prefix.empty() ? item.key() : prefix + "." + item.key());
    }
  } else if (module.fqn().empty()) {
    return;  // an unnamed module inside a tracked one counts for its caller
  }
  fqn_ = module.fqn();
  scope_.emplace(fqn_);  // the root's "" scope marks the outermost call
  if (fqn_.empty()) return;
  CommDebugMode::note_module(fqn_);
  if (!c10::GradMode::is_enabled()) return;

  auto state = std::make_shared<InputGradState>();
  state->fqn = fqn_;
  auto count = [&](const at::Tensor& t) {
    ++state->expected;
    inputs_.insert(t.unsafeGetTensorImpl());
  };
  for (const auto& a : call.args) for_each_hookable(a, count);
  for (const auto& [k, v] : call.kwargs) for_each_hookable(v, count);
  auto hook = [&](const at::Tensor& t) {
    t.register_hook([state](const at::Tensor&) {
      const int task = torch::autograd::get_current_graph_task_id();
      if (state->task != task) {  // a new backward pass over a retained graph
        state->task = task;
        state->seen = 0;
      }
      if (++state->seen == state->expected) ModuleScope::exit_backward(state->fqn);
    });
  };
  for (const auto& a : call.args) for_each_hookable(a, hook);
  for (const auto& [k, v] : call.kwargs) for_each_hookable(v, hook);
}

void TrackedCall::track_output(const c10::IValue& output) const {
  if (fqn_.empty() || !c10::GradMode::is_enabled()) return;
  for_each_hookable(output, [&](const at::Tensor& t) {
    if (inputs_.count(t.unsafeGetTensorImpl())) return;
    t.register_hook([fqn = fqn_](const at::Tensor&) { ModuleScope::enter_backward(fqn); });
  });
}

}  // namespace dtensor::tp
