#include "dtensor/tp/module_hooks.h"

#include <algorithm>

#include "dtensor/tp/module_tracker.h"

namespace dtensor::tp {

c10::IValue* ModuleCall::kwarg(const std::string& name) {
  for (auto& [k, v] : kwargs)
    if (k == name) return &v;
  return nullptr;
}

const c10::IValue* ModuleCall::kwarg(const std::string& name) const {
  return const_cast<ModuleCall*>(this)->kwarg(name);
}

size_t HookedModule::register_forward_pre_hook(ForwardPreHook hook) {
  pre_hooks_.emplace_back(next_handle_, std::move(hook));
  return next_handle_++;
}

size_t HookedModule::register_forward_hook(ForwardHook hook) {
  hooks_.emplace_back(next_handle_, std::move(hook));
  return next_handle_++;
}

void HookedModule::remove_hook(size_t handle) {
  auto matches = [handle](const auto& entry) { return entry.first == handle; };
  std::erase_if(pre_hooks_, matches);
  std::erase_if(hooks_, matches);
}

torch::nn::Module& HookedModule::as_module() {
  auto* module = dynamic_cast<torch::nn::Module*>(this);
  TORCH_CHECK(module != nullptr, "HookedModule must be mixed into a torch::nn::Module");
  return *module;
}

c10::IValue HookedModule::call_forward_kw(const std::function<c10::IValue(const ModuleCall&)>& body,
                                          ModuleCall call) {
  TrackedCall tracked(*this, call);  // CommDebugMode's per-module attribution
  torch::nn::Module& self = as_module();
  for (auto& [handle, hook] : pre_hooks_) hook(self, call);
  c10::IValue out = body(call);
  for (auto& [handle, hook] : hooks_) hook(self, call, out);
  tracked.track_output(out);
  return out;
}

void name_modules(torch::nn::Module& root) {
  if (auto* hooked = dynamic_cast<HookedModule*>(&root)) hooked->set_fqn("");
  for (const auto& item : root.named_modules("", /*include_self=*/false))
    if (auto* hooked = dynamic_cast<HookedModule*>(item.value().get())) hooked->set_fqn(item.key());
}

}  // namespace dtensor::tp
