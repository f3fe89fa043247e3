#include "dtensor/optim/capturable_adamw.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <memory>

#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"

namespace dtensor::optim {
namespace {

using torch::optim::AdamWOptions;

void check_options(const AdamWOptions& o) {
  TORCH_CHECK(o.lr() >= 0, "CapturableAdamW: invalid learning rate: ", o.lr());
  TORCH_CHECK(o.eps() >= 0, "CapturableAdamW: invalid epsilon value: ", o.eps());
  const auto [beta1, beta2] = o.betas();
  TORCH_CHECK(0 <= beta1 && beta1 < 1,
              "CapturableAdamW: invalid beta parameter at index 0: ", beta1);
  TORCH_CHECK(0 <= beta2 && beta2 < 1,
              "CapturableAdamW: invalid beta parameter at index 1: ", beta2);
  TORCH_CHECK(o.weight_decay() >= 0,
              "CapturableAdamW: invalid weight_decay value: ", o.weight_decay());
}

at::Tensor local_of(const at::Tensor& t) { return is_dtensor(t) ? dtensor_impl(t)->local() : t; }

// The gradient's local tensor laid out as its parameter: the update is element-wise, so both
// must hold the same elements. A Partial gradient (sequence parallelism) is reduced here.
at::Tensor local_grad(const at::Tensor& param) {
  const at::Tensor& grad = param.grad();
  TORCH_CHECK(!grad.is_sparse(), "CapturableAdamW does not support sparse gradients");
  TORCH_CHECK(is_dtensor(grad) == is_dtensor(param), "CapturableAdamW: a ",
              is_dtensor(param) ? "DTensor" : "plain", " parameter of shape ", param.sizes(),
              " has a ", is_dtensor(grad) ? "DTensor" : "plain", " gradient");
  if (!is_dtensor(grad)) return grad;
  const DTensorSpec& want = *dtensor_impl(param)->spec();
  if (*dtensor_impl(grad)->spec() == want) return dtensor_impl(grad)->local();
  return local_of(redistribute(grad, want.mesh(), want.placements()));
}

// The tensors of one param group's update, as local tensors, in the same order.
struct Lists {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
};

// One AdamW step over every list at once. The step counts and both bias corrections stay
// tensors on the device; the scalars are the group's options. Per parameter, with t the new
// step: p *= 1 - lr*wd; m = beta1*m + (1-beta1)*g; v = beta2*v + (1-beta2)*g²;
// p += -lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps), v replaced by max(v_max, v) with
// AMSGrad. The step size is folded into the denominator (one division instead of a scaled
// addcdiv), which rounds differently from torch::optim::AdamW only in the last bits.
void update(Lists& l, const AdamWOptions& o) {
  const auto [beta1, beta2] = o.betas();
  if (o.weight_decay() != 0) at::_foreach_mul_(l.params, 1 - o.lr() * o.weight_decay());
  at::_foreach_add_(l.steps, 1);
  // step_size = lr / (beta1^t - 1) = -lr / (1 - beta1^t)
  std::vector<at::Tensor> step_size = at::_foreach_pow(beta1, l.steps);
  at::_foreach_sub_(step_size, 1);
  at::_foreach_div_(step_size, o.lr());
  at::_foreach_reciprocal_(step_size);
  // sqrt(1 - beta2^t)
  std::vector<at::Tensor> correction2_sqrt = at::_foreach_pow(beta2, l.steps);
  at::_foreach_sub_(correction2_sqrt, 1);
  at::_foreach_neg_(correction2_sqrt);
  at::_foreach_sqrt_(correction2_sqrt);

  at::_foreach_mul_(l.exp_avgs, beta1);
  at::_foreach_add_(l.exp_avgs, l.grads, 1 - beta1);
  at::_foreach_mul_(l.exp_avg_sqs, beta2);
  at::_foreach_addcmul_(l.exp_avg_sqs, l.grads, l.grads, 1 - beta2);
  if (o.amsgrad()) at::_foreach_maximum_(l.max_exp_avg_sqs, l.exp_avg_sqs);
  std::vector<at::Tensor> denom =
      at::_foreach_sqrt(o.amsgrad() ? l.max_exp_avg_sqs : l.exp_avg_sqs);
  at::_foreach_div_(denom, correction2_sqrt);
  at::_foreach_add_(denom, o.eps());
  at::_foreach_div_(denom, step_size);  // -(sqrt(v̂) + eps) / step size
  at::_foreach_addcdiv_(l.params, l.exp_avgs, denom);
}

}  // namespace

CapturableAdamW::CapturableAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                                 AdamWOptions defaults)
    : Optimizer(std::move(param_groups), std::make_unique<AdamWOptions>(defaults)) {
  check_options(defaults);
}

CapturableAdamW::CapturableAdamW(std::vector<at::Tensor> params, AdamWOptions defaults)
    : CapturableAdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {
}

at::Tensor CapturableAdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const AdamWOptions&>(group.options());
    Lists l;
    std::vector<at::Tensor> wrappers;  // DTensor parameters, whose local tensors are updated
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto s = std::make_unique<CapturableAdamWParamState>();
        s->step(at::zeros({}, local_of(p).options().dtype(at::kDouble)));
        // zeros_like keeps a DTensor's spec: the moments are laid out as the parameter.
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<CapturableAdamWParamState&>(*slot);
      TORCH_CHECK(!options.amsgrad() || s.max_exp_avg_sq().defined(),
                  "CapturableAdamW: amsgrad was turned on after a parameter of shape ", p.sizes(),
                  " took steps without it");
      l.grads.push_back(local_grad(p));
      l.params.push_back(local_of(p));
      if (is_dtensor(p)) wrappers.push_back(p);
      l.exp_avgs.push_back(local_of(s.exp_avg()));
      l.exp_avg_sqs.push_back(local_of(s.exp_avg_sq()));
      if (options.amsgrad()) l.max_exp_avg_sqs.push_back(local_of(s.max_exp_avg_sq()));
      l.steps.push_back(s.step());
    }
    if (l.params.empty()) continue;
    update(l, options);
    // Writing a local tensor bumps its own version, not the wrapper's; FSDP's kept gathers and
    // autograd's saved-tensor checks read the wrapper's.
    for (const auto& p : wrappers) p.unsafeGetTensorImpl()->bump_version();
  }
  return loss;
}

}  // namespace dtensor::optim
