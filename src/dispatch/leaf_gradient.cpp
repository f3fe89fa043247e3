#include "leaf_gradient.h"

#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "dtensor/core/api.h"
#include "dtensor/core/redistribute.h"

namespace dtensor::dispatch {
namespace {

// A derivative formula that builds a gradient from nothing makes a plain tensor: derivatives.yaml's
// zeros_like(x) becomes at::zeros(x's sizes, x's options) (copysign's and nextafter's `other`),
// sgn of a real input returns at::_efficientzerotensor, repeat with a zero count at::zeros. None
// of these dispatches on a DTensor, and autograd hands the result to the leaf unchanged (it
// checks only shape, dtype and device). Its value is the global gradient, the same on every rank
// (which is why the kernel counts such tensors as Replicate inside backward), so this rank keeps
// its part of it, in the leaf's layout; no collective is needed. Runs for `.backward()`
// (AccumulateGrad's tensor pre-hooks) and for torch::autograd::grad (captured gradients pass
// through the same hooks).
class PlainGradientToDTensor final : public torch::autograd::FunctionPreHook {
 public:
  explicit PlainGradientToDTensor(const c10::intrusive_ptr<c10::TensorImpl>& leaf) : leaf_(leaf) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (grads.empty() || !grads[0].defined() || is_dtensor(grads[0])) return grads;
    const auto leaf = leaf_.lock();
    if (!leaf) return grads;
    const DTensorSpec& spec = *static_cast<const DTensorImpl*>(leaf.get())->spec();
    at::Tensor g = grads[0];
    // A ZeroTensor cannot be written, and a later backward accumulates into the leaf's gradient.
    if (g._is_zerotensor()) g = at::zeros(g.sizes(), g.options());
    torch::autograd::variable_list out = grads;
    // Differentiable, for create_graph: from_local and redistribute are autograd Functions.
    out[0] = redistribute(from_local(g, spec.mesh(), replicate_all(spec.mesh().ndim())),
                          spec.mesh(), backward_target(spec.placements()));
    return out;
  }

 private:
  c10::weak_intrusive_ptr<c10::TensorImpl> leaf_;  // the hook lives in the leaf's own metadata
};

}  // namespace

void watch_leaf_gradient(const at::Tensor& dtensor) {
  if (!c10::GradMode::is_enabled()) return;  // no graph is recorded
  const auto* meta = torch::autograd::impl::get_autograd_meta(dtensor);
  // requires_grad_ is set on leaves only (a result's requires_grad comes from its grad_fn).
  if (meta == nullptr || !meta->requires_grad_ || meta->grad_fn_) return;
  auto& hooks = torch::autograd::impl::hooks(dtensor);
  for (const auto& h : hooks) {
    if (dynamic_cast<const PlainGradientToDTensor*>(h.get()) != nullptr) return;
  }
  // First, so that the user's hooks (Tensor::register_hook) see the DTensor too. Registering
  // the first of those clears a tensor's hooks; the next op on the leaf installs this again.
  hooks.insert(hooks.begin(), std::make_unique<PlainGradientToDTensor>(dtensor.getIntrusivePtr()));
}

}  // namespace dtensor::dispatch
