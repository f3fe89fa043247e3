#include "dtensor/comm/capture_rehearsal.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <string_view>

namespace dtensor::comm {
namespace {

std::atomic<CaptureRehearsal*> active{nullptr};

// Ops that read a value on the host or size their output by the data. Some (nonzero's
// masked_select's) call others listed here: the outermost one is reported.
constexpr std::string_view kHostSyncOps[] = {
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::equal",
    "aten::allclose",
    "aten::nonzero",
    "aten::nonzero_numpy",
    "aten::argwhere",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
    "aten::bincount",
};

const c10::IValue* input(const at::RecordFunction& fn, size_t i) {
  const auto inputs = fn.inputs();
  return i < inputs.size() ? &inputs[i] : nullptr;
}

bool on_device(const c10::IValue* v) {
  return v != nullptr && v->isTensor() && v->toTensor().defined() && !v->toTensor().is_cpu() &&
         !v->toTensor().is_meta();
}

// Whether the op with these inputs synchronises with the host.
bool synchronises(const at::RecordFunction& fn) {
  const std::string_view name = fn.name();
  for (std::string_view op : kHostSyncOps)
    if (name == op) return true;
  if (name == "aten::repeat_interleave") {
    // repeat_interleave.Tensor(repeats, *, output_size=None): the size is the sum of repeats.
    const auto inputs = fn.inputs();
    return inputs.size() >= 2 && inputs.back().isNone() && inputs[0].isTensor();
  }
  // A copy from a device to the host: copy_(self on the host, src on a device), or
  // _to_copy(self on a device, ..., device=cpu).
  if (name == "aten::copy_") {
    const c10::IValue *self = input(fn, 0), *src = input(fn, 1);
    return on_device(src) && self != nullptr && self->isTensor() && self->toTensor().is_cpu();
  }
  if (name == "aten::_to_copy") {
    const c10::IValue* self = input(fn, 0);
    const c10::IValue* device = input(fn, 3);  // (self, dtype, layout, device, ...)
    return on_device(self) && device != nullptr && device->isDevice() &&
           device->toDevice().is_cpu();
  }
  return false;
}

// Ops that run on the device without the host waiting, whose CPU kernels read values: on CUDA
// _assert_async checks on the device (a captured graph keeps the check).
bool device_side(std::string_view name) { return name == "aten::_assert_async"; }

// Set while an op already reported (or a device_side one) runs on this thread: the ops it calls
// are its own.
thread_local int reported_depth = 0;
struct Reported : at::ObserverContext {};

}  // namespace

std::string HostSync::str() const {
  std::string s = op;
  if (!module.empty()) s += " in module '" + module + "'";
  if (backward) s += " (backward)";
  return s;
}

std::unique_ptr<at::ObserverContext> CaptureRehearsal::on_op(const at::RecordFunction& fn) {
  CaptureRehearsal* r = active.load();
  if (r == nullptr || reported_depth > 0) return nullptr;
  if (device_side(fn.name())) {
    ++reported_depth;
    return std::make_unique<Reported>();
  }
  if (!synchronises(fn)) return nullptr;
  HostSync s{fn.name(), ModuleScope::current(), BackwardScope::active()};
  {
    std::lock_guard<std::mutex> lock(r->mu_);
    r->syncs_.push_back(std::move(s));
  }
  ++reported_depth;
  return std::make_unique<Reported>();
}

void CaptureRehearsal::on_op_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx != nullptr) --reported_depth;
}

CaptureRehearsal::CaptureRehearsal() {
  CaptureRehearsal* none = nullptr;
  TORCH_CHECK(active.compare_exchange_strong(none, this),
              "CaptureRehearsal: another rehearsal is already running");
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(&CaptureRehearsal::on_op, &CaptureRehearsal::on_op_end)
          .needsInputs(true)
          .scopes({at::RecordScope::FUNCTION}));
}

CaptureRehearsal::~CaptureRehearsal() {
  at::removeCallback(handle_);
  active = nullptr;
}

std::vector<HostSync> CaptureRehearsal::syncs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return syncs_;
}

void CaptureRehearsal::check() const {
  const auto all = syncs();
  if (all.empty()) return;
  TORCH_CHECK(false, "capture rehearsal: ", all.front().str(),
              " would synchronise with the host (a captured graph cannot read values back or "
              "size outputs by data)",
              all.size() > 1 ? "; " + std::to_string(all.size()) + " such ops in all" : "");
}

void rehearse_capture(const std::function<void()>& body) {
  CaptureRehearsal rehearsal;
  body();
  rehearsal.check();
}

}  // namespace dtensor::comm
