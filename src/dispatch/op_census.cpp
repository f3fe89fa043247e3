#include "dtensor/dispatch/op_census.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <string_view>
#include <unordered_map>

#include "dtensor/core/dtensor_impl.h"

namespace dtensor::dispatch {
namespace {

std::atomic<OpCensus*> active{nullptr};

bool has_dtensor_argument(const at::RecordFunction& fn) {
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor() && is_dtensor(v.toTensor())) return true;
    if (v.isList()) {  // Tensor[] and Tensor?[]
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor() && is_dtensor(e.toTensor())) return true;
    }
  }
  return false;
}

// ATen and c10d operators; not the autograd engine's own ranges ("autograd::engine::...",
// "detach_"), which are no kernels.
bool is_operator(std::string_view name) {
  return name.find("::") != std::string_view::npos && name.rfind("autograd::", 0) != 0;
}

// Whether the operator decomposes above autograd (linear, cross_entropy): on DTensors it never
// reaches our kernel, so it is counted as its pieces on plain tensors too.
bool decomposes(const at::RecordFunction& fn) {
  const auto name = fn.operator_name();
  if (!name) return false;
  thread_local std::unordered_map<std::string, bool> known;
  const std::string key = name->name + "." + name->overload_name;
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  const auto handle = c10::Dispatcher::singleton().findOp(*name);
  const bool composite =
      handle && handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
  return known.emplace(key, composite).first->second;
}

// One running op on this thread, and whether it is counted.
struct Running : at::ObserverContext {
  bool counted = false;
};
thread_local int counted_depth = 0;  // counted ops running on this thread

}  // namespace

std::unique_ptr<at::ObserverContext> OpCensus::on_op(const at::RecordFunction& fn) {
  OpCensus* census = active.load();
  // Inside a counted op, what it calls is its own work.
  if (census == nullptr || counted_depth > 0) return nullptr;
  if (!is_operator(fn.name()) || has_dtensor_argument(fn) || decomposes(fn)) return nullptr;
  {
    std::lock_guard<std::mutex> lock(census->mu_);
    ++census->counts_[fn.name()];
  }
  ++counted_depth;
  auto ctx = std::make_unique<Running>();
  ctx->counted = true;
  return ctx;
}

void OpCensus::on_op_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx != nullptr && static_cast<Running*>(ctx)->counted) --counted_depth;
}

OpCensus::OpCensus() {
  OpCensus* none = nullptr;
  TORCH_CHECK(active.compare_exchange_strong(none, this),
              "OpCensus: another census is already counting");
  handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&OpCensus::on_op, &OpCensus::on_op_end)
                                      .needsInputs(true)
                                      .scopes({at::RecordScope::FUNCTION}));
}

OpCensus::~OpCensus() {
  at::removeCallback(handle_);
  active = nullptr;
}

std::map<std::string, int64_t> OpCensus::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

int64_t OpCensus::total() const {
  int64_t n = 0;
  for (const auto& [name, count] : counts()) n += count;
  return n;
}

}  // namespace dtensor::dispatch
