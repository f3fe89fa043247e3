#include "flop_counter.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "dtensor/core/dtensor_impl.h"

namespace dtensor::plan {
namespace {

std::atomic<FlopCounter*> active{nullptr};

double numel_of(at::IntArrayRef sizes) {
  double n = 1;
  for (int64_t s : sizes) n *= static_cast<double>(s);
  return n;
}

// 2 m k n for a [.., m, k] x [.., k, n] product (batch dims multiply).
double matmul_flops(const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() < 2 || b.dim() < 2) return 0;
  return 2 * numel_of(a.sizes()) * static_cast<double>(b.size(-1));
}

// q [B, H, L, E], k [B, H, S, E], v [B, H, S, Ev]: QK^T and AV.
double attention_flops(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return 0;
  const double bhl = static_cast<double>(q.size(0) * q.size(1) * q.size(2));
  const double s = static_cast<double>(k.size(2));
  return 2 * bhl * s * static_cast<double>(q.size(3)) +
         2 * bhl * s * static_cast<double>(v.size(3));
}

bool named(const char* name, const char* op) { return std::strcmp(name, op) == 0; }

}  // namespace

double FlopCounter::flops_of(const char* name, c10::ArrayRef<const c10::IValue> in) {
  auto tensor = [&](size_t i) -> const at::Tensor* {
    return i < in.size() && in[i].isTensor() ? &in[i].toTensor() : nullptr;
  };
  const at::Tensor* a = tensor(0);
  if (a == nullptr || !a->defined() || is_dtensor(*a)) return 0;  // counted in its local op
  if (named(name, "aten::mm") || named(name, "aten::bmm")) {
    const at::Tensor* b = tensor(1);
    return b ? matmul_flops(*a, *b) : 0;
  }
  if (named(name, "aten::addmm") || named(name, "aten::baddbmm")) {
    const at::Tensor *m1 = tensor(1), *m2 = tensor(2);
    return m1 && m2 ? matmul_flops(*m1, *m2) : 0;
  }
  const bool flash = named(name, "aten::_scaled_dot_product_flash_attention_for_cpu") ||
                     named(name, "aten::_scaled_dot_product_flash_attention") ||
                     named(name, "aten::_scaled_dot_product_efficient_attention");
  const bool flash_backward =
      named(name, "aten::_scaled_dot_product_flash_attention_for_cpu_backward") ||
      named(name, "aten::_scaled_dot_product_flash_attention_backward") ||
      named(name, "aten::_scaled_dot_product_efficient_attention_backward");
  if (flash) {
    const at::Tensor *k = tensor(1), *v = tensor(2);
    return k && v ? attention_flops(*a, *k, *v) : 0;
  }
  if (flash_backward) {  // (grad_out, query, key, value, ...): dQ, dK, dV and dP
    const at::Tensor *q = tensor(1), *k = tensor(2), *v = tensor(3);
    return q && k && v ? 2 * attention_flops(*q, *k, *v) : 0;
  }
  return 0;
}

// Inside a counted op on this thread: the ops it calls (a CPU matmul's own mm.out) are its
// work, already counted.
thread_local int counted_depth = 0;
struct Counted : at::ObserverContext {};

std::unique_ptr<at::ObserverContext> FlopCounter::on_op(const at::RecordFunction& fn) {
  FlopCounter* counter = active.load();
  if (counter == nullptr || counted_depth > 0) return nullptr;
  const double f = flops_of(fn.name(), fn.inputs());
  if (f <= 0) return nullptr;
  counter->flops_.fetch_add(f);
  ++counted_depth;
  return std::make_unique<Counted>();
}

void FlopCounter::on_op_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx != nullptr) --counted_depth;
}

FlopCounter::FlopCounter() {
  FlopCounter* none = nullptr;
  TORCH_CHECK(active.compare_exchange_strong(none, this),
              "FlopCounter: another counter is already counting");
  handle_ =
      at::addGlobalCallback(at::RecordFunctionCallback(&FlopCounter::on_op, &FlopCounter::on_op_end)
                                .needsInputs(true)
                                .scopes({at::RecordScope::FUNCTION}));
}

FlopCounter::~FlopCounter() {
  at::removeCallback(handle_);
  active = nullptr;
}

}  // namespace dtensor::plan
