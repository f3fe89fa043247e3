// The vocab-parallel cross entropy as one call (a model's loss): LossParallel's computation in
// an autograd function, so the caller's backward needs no guard.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/ops/layout_invariant.h"
#include "dtensor/tp/loss_parallel.h"

namespace dtensor::tp {
namespace {

// Vocab-parallel cross entropy as an autograd function whose backward re-enters LossParallel,
// so callers may run backward anywhere. The inner graph (log_softmax + nll_loss on a detached
// alias of the logits) is built in forward and differentiated in backward.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, int64_t reduction) {
    at::AutoGradMode enable_grad(true);
    LossParallel loss_parallel;
    auto x = logits.detach().requires_grad_(logits.requires_grad());
    auto loss =
        at::cross_entropy_loss(x.flatten(0, -2), targets.flatten(), /*weight=*/{}, reduction);
    ctx->saved_data["x"] = x;
    ctx->saved_data["loss"] = loss;
    return local_tensor(loss).clone();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    LossParallel loss_parallel;
    auto x = ctx->saved_data["x"].toTensor();
    auto loss = ctx->saved_data["loss"].toTensor();
    at::Tensor grad_loss;
    {
      at::NoGradGuard no_grad;
      grad_loss = from_local(grads[0].to(local_tensor(loss).options()), device_mesh(loss),
                             placements(loss));
    }
    auto grad_x = torch::autograd::grad({loss}, {x}, {grad_loss})[0];
    return {grad_x, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t reduction) {
  TORCH_CHECK(is_dtensor(logits),
              "vocab_parallel_cross_entropy: expected logits that are a "
              "DTensor sharded on the class (last) dim, got a plain tensor of shape ",
              logits.sizes(), "; use at::cross_entropy_loss for plain logits");
  const at::Tensor plain_targets = is_dtensor(targets) ? full_tensor(targets) : targets;
  TORCH_CHECK(reduction == at::Reduction::Mean || reduction == at::Reduction::Sum,
              "vocab_parallel_cross_entropy: reduction must be Mean or Sum");
  // Logits whole on every rank (split over one rank, e.g. TP=1): plain LibTorch's loss on the
  // local tensor, its ops and bits, instead of the vocab-parallel pieces. Not in the
  // layout-invariant mode, whose canonical sum over the classes is the same at every degree.
  const auto& spec = *dtensor_impl(logits)->spec();
  bool whole = ops::layout_invariant_segments() == 0;
  for (size_t m = 0; m < spec.placements().size(); ++m) {
    whole &= spec.placements()[m].is_replicate() || spec.mesh().size(static_cast<int64_t>(m)) == 1;
  }
  if (whole) {
    // The gradient comes back as the logits' placements with any Partial read as Replicate.
    const Placements grad = clear_partial(spec.placements());
    return at::cross_entropy_loss(
        to_local(logits, std::vector<Placement>(grad.begin(), grad.end())).flatten(0, -2),
        plain_targets.flatten(), /*weight=*/{}, reduction);
  }
  return VocabParallelCrossEntropy::apply(logits, plain_targets, reduction);
}

}  // namespace dtensor::tp
