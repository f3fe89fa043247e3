#include "dtensor/tp/module_hooks.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "dtensor/tp/forward_wrapper.h"
#include "dtensor/tp/module_tracker.h"
#include "style_support.h"

namespace dtensor::tp {

c10::IValue* ModuleCall::kwarg(const std::string& name) {
  for (auto& [k, v] : kwargs)
    if (k == name) return &v;
  return nullptr;
}

const c10::IValue* ModuleCall::kwarg(const std::string& name) const {
  return const_cast<ModuleCall*>(this)->kwarg(name);
}

namespace {

// Hook-capable modules whose call_forward is under way on this thread, innermost last.
thread_local std::vector<const HookedModule*> t_running;
thread_local int t_direct_calls = 0;

bool is_running(const HookedModule* m) {
  return std::find(t_running.begin(), t_running.end(), m) != t_running.end();
}

struct RunningScope {
  explicit RunningScope(const HookedModule* m) { t_running.push_back(m); }
  ~RunningScope() { t_running.pop_back(); }
  RunningScope(const RunningScope&) = delete;
  RunningScope& operator=(const RunningScope&) = delete;
};

// Forward wrappers by module. Each entry remembers its module's owner: a wrapper whose module
// is gone is dropped, never inherited by a new module at the same address.
struct WrapperEntry {
  std::weak_ptr<torch::nn::Module> owner;
  std::shared_ptr<const ForwardWrapper> wrapper;
};
std::mutex g_wrappers_mu;
std::unordered_map<const HookedModule*, WrapperEntry> g_wrappers;
std::atomic<size_t> g_wrapper_count{0};  // lets calls skip the lookup when there are none

std::shared_ptr<const ForwardWrapper> wrapper_of(const HookedModule* m) {
  if (g_wrapper_count.load(std::memory_order_relaxed) == 0) return nullptr;
  std::lock_guard<std::mutex> l(g_wrappers_mu);
  auto it = g_wrappers.find(m);
  if (it == g_wrappers.end() || it->second.owner.expired()) return nullptr;
  return it->second.wrapper;
}

// The module of the innermost BodyOnlyCall on this thread and its saved call.
thread_local const void* t_body_only_module = nullptr;
thread_local const ModuleCall* t_body_only_call = nullptr;

HookedModule& hooked(torch::nn::Module& module, const char* what) {
  auto* h = dynamic_cast<HookedModule*>(&module);
  TORCH_CHECK(h != nullptr, "dtensor: ", what,
              " needs a hook-capable module (a dtensor::nn layer or a ",
              "dtensor::nn::Module that routes its forward through call_forward); ", module.name(),
              " is a plain torch::nn::Module");
  return *h;
}

std::string describe(HookedModule& m) {
  auto* module = dynamic_cast<torch::nn::Module*>(&m);
  return module ? detail::describe_module(*module, m.fqn()) : "module '" + m.fqn() + "'";
}

}  // namespace

HookedModule& HookedModule::operator=(const HookedModule& other) {
  pre_hooks_ = other.pre_hooks_;
  hooks_ = other.hooks_;
  next_handle_ = other.next_handle_;
  fqn_ = other.fqn_;
  return *this;
}

HookedModule* HookedModule::hooked_parent() const {
  if (parent_owned_ && parent_owner_.expired()) return nullptr;
  return parent_;
}

void HookedModule::set_hooked_parent(HookedModule* parent) {
  parent_ = parent;
  parent_owner_.reset();
  parent_owned_ = false;
  if (auto* module = dynamic_cast<torch::nn::Module*>(parent)) {
    parent_owner_ = module->weak_from_this();
    parent_owned_ = !parent_owner_.expired();
  }
}

void HookedModule::check_ancestors_ran() {
  if (t_direct_calls > 0) return;
  for (HookedModule* a = hooked_parent(); a != nullptr; a = a->hooked_parent()) {
    if (is_running(a)) return;  // the call came through `a`, and everything below it ran
    if (a->num_hooks() == 0) continue;
    TORCH_CHECK(false, "dtensor: ", describe(*this), " was called while its ancestor ",
                describe(*a), ", which has ", a->num_hooks(),
                " forward hook(s) (a parallel style's input/output conversions), was not "
                "running through call_forward: its forward hooks did not run, so its inputs and "
                "outputs were not converted and the result would be silently wrong. Route that "
                "module's forward through call_forward (dtensor/tp/module_hooks.h). To call '",
                fqn_,
                "' on its own on purpose, without its ancestors' hooks, hold a "
                "dtensor::tp::DirectCallGuard.");
  }
}

DirectCallGuard::DirectCallGuard() { ++t_direct_calls; }
DirectCallGuard::~DirectCallGuard() { --t_direct_calls; }

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
  if (t_body_only_module == this) {
    const ModuleCall& saved = *t_body_only_call;
    t_body_only_module = nullptr;  // the body's own calls of this module run normally
    RunningScope running(this);
    TrackedCall tracked(*this, saved);
    c10::IValue out = body(saved);
    tracked.track_output(out);
    return out;
  }
  check_ancestors_ran();
  RunningScope running(this);
  TrackedCall tracked(*this, call);  // CommDebugMode's per-module attribution
  torch::nn::Module& self = as_module();
  for (auto& [handle, hook] : pre_hooks_) hook(self, call);
  auto wrapper = wrapper_of(this);
  c10::IValue out = wrapper ? (*wrapper)(self, call, body) : body(call);
  for (auto& [handle, hook] : hooks_) hook(self, call, out);
  tracked.track_output(out);
  return out;
}

void set_forward_wrapper(torch::nn::Module& module, ForwardWrapper wrapper) {
  HookedModule& h = hooked(module, "set_forward_wrapper");
  std::weak_ptr<torch::nn::Module> owner = module.weak_from_this();
  TORCH_CHECK(!wrapper || !owner.expired(), "dtensor: set_forward_wrapper: ", module.name(),
              " is not owned by a shared_ptr; create it through its module holder "
              "(TORCH_MODULE) or std::make_shared");
  std::lock_guard<std::mutex> l(g_wrappers_mu);
  std::erase_if(g_wrappers, [](const auto& e) { return e.second.owner.expired(); });
  if (wrapper) {
    g_wrappers[&h] = {owner, std::make_shared<const ForwardWrapper>(std::move(wrapper))};
  } else {
    g_wrappers.erase(&h);
  }
  g_wrapper_count.store(g_wrappers.size(), std::memory_order_relaxed);
}

bool has_forward_wrapper(const torch::nn::Module& module) {
  auto* h = dynamic_cast<const HookedModule*>(&module);
  return h != nullptr && wrapper_of(h) != nullptr;
}

BodyOnlyCall::BodyOnlyCall(torch::nn::Module& module, const ModuleCall& call)
    : prev_module_(t_body_only_module), prev_call_(t_body_only_call) {
  t_body_only_module = &hooked(module, "BodyOnlyCall");
  t_body_only_call = &call;
}

BodyOnlyCall::~BodyOnlyCall() {
  t_body_only_module = prev_module_;
  t_body_only_call = prev_call_;
}

namespace {

// Links the hook-capable modules under `module` to their nearest hook-capable ancestor.
void link_parents(torch::nn::Module& module, HookedModule* nearest) {
  for (const auto& child : module.children()) {
    auto* hooked = dynamic_cast<HookedModule*>(child.get());
    if (hooked) hooked->set_hooked_parent(nearest);
    link_parents(*child, hooked ? hooked : nearest);
  }
}

}  // namespace

void name_modules(torch::nn::Module& root) {
  auto* hooked_root = dynamic_cast<HookedModule*>(&root);
  if (hooked_root) hooked_root->set_fqn("");
  for (const auto& item : root.named_modules("", /*include_self=*/false))
    if (auto* hooked = dynamic_cast<HookedModule*>(item.value().get())) hooked->set_fqn(item.key());
  link_parents(root, hooked_root);
}

}  // namespace dtensor::tp
