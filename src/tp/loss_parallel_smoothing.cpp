// loss_parallel with label smoothing. at::cross_entropy decomposes a smoothed loss into
// (1 - eps) * nll_loss(log_softmax(x)) + eps / C * smooth, smooth = -sum_c w_c log_softmax(x)_c.
// Under loss_parallel the log_softmax backward is a pass-through (nll_loss_backward already
// returns the logits' gradient), so smooth's gradient would reach the logits without the
// softmax correction: wrong gradients (PyTorch's loss_parallel has this limitation).
//
// So while a LossParallel lives, cross_entropy_loss on DTensor logits with label smoothing is
// taken over at the autograd key (everything else keeps the composite): log_softmax and
// nll_loss run as usual (3 all_reduces, gradient fused in nll_loss_backward), and smooth is an
// autograd function of the logits whose backward is the exact local gradient
// g * (softmax * sum(w) - w). Forward costs one more all_reduce of N elements (the class sum of
// this rank's w_c log_softmax_c), backward still none.
#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <ATen/ops/cross_entropy_loss_native.h>
#include <torch/autograd.h>

#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/core/shard_math.h"
#include "dtensor/dispatch/op_call.h"
#include "dtensor/ops/kernel_collectives.h"
#include "dtensor/ops/layout_invariant.h"
#include "dtensor/tp/loss_parallel.h"

namespace dtensor::tp::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A target / weight whole on this rank: plain tensors are used as they are (Replicate, like the
// nll_loss rule), DTensors are redistributed to Replicate first.
at::Tensor whole(const at::Tensor& t) {
  if (!is_dtensor(t)) return t;
  if (spec_of(t).is_replicated()) return local_tensor(t);
  return local_tensor(redistribute(t, replicate_all(static_cast<int64_t>(placements(t).size()))));
}

// smooth = -sum_c w_c * log_softmax(logits)_c per target position, zero where the target is
// ignored, then reduced like at::cross_entropy (mean divides by the kept targets' weight).
// Only `logits` receives a gradient; `logp` (its vocab-parallel log_softmax) is read, not
// differentiated, because its backward under loss_parallel is a pass-through.
struct SmoothingTerm : torch::autograd::Function<SmoothingTerm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*logits*/,
                            const at::Tensor& logp, const at::Tensor& target,
                            const at::Tensor& weight, int64_t reduction, int64_t ignore_index) {
    const DTensorSpec& spec = spec_of(logp);
    const int64_t c = logp.dim() >= 2 ? 1 : 0;
    const LocalShard shard = spec.local_shard();
    const at::Tensor lp = local_tensor(logp);
    const at::Tensor t = whole(target);
    const at::Tensor keep = t.ne(ignore_index);

    // This rank's classes: w_c (a slice of the replicated weight) and the weights' total.
    // No class weights arrive as an empty tensor: autograd Functions cannot take undefined inputs.
    const at::Tensor w = weight.numel() > 0 ? whole(weight).to(lp.scalar_type()) : at::Tensor();
    at::Tensor w_local, w_total;
    if (w.defined()) {
      std::vector<int64_t> view(lp.dim(), 1);
      view[c] = shard.shape[c];
      w_local = w.narrow(0, shard.offset[c], shard.shape[c]).view(view);
      w_total = w.sum();
    } else {
      w_total = at::scalar_tensor(static_cast<double>(spec.shape()[c]), lp.options());
    }
    const at::Tensor weighted = w_local.defined() ? lp * w_local : lp;
    constexpr const char* kOp = "aten::cross_entropy_loss (label smoothing, loss parallel)";
    // In LayoutInvariantMode the classes' sum is taken in the canonical order (negating after
    // the sum is exact: the same bits as summing the negated parts).
    at::Tensor smooth =
        ops::layout_invariant_segments() > 0
            ? ops::canonical_reduce(
                  weighted, c, [c](const at::Tensor& s) { return s.sum(c); }, &spec.mesh(), 0, kOp)
                  .neg()
            : ops::kernel_all_reduce(kOp, weighted.sum(c).neg(), ReduceOp::Sum, spec.mesh(), 0);
    smooth.masked_fill_(keep.logical_not(), 0);

    at::Tensor denom;
    at::Tensor out;
    if (reduction == at::Reduction::Mean) {
      denom = w.defined() ? w.index_select(0, t.masked_select(keep)).sum()
                          : keep.sum().to(lp.scalar_type());
      out = smooth.sum() / denom;
    } else if (reduction == at::Reduction::Sum) {
      out = smooth.sum();
    } else {
      TORCH_CHECK(reduction == at::Reduction::None,
                  "Invalid reduction type encountered in cross_entropy: ", reduction);
      out = smooth;
    }

    ctx->save_for_backward({logp});
    ctx->saved_data["keep"] = keep;
    ctx->saved_data["w_local"] = w_local;
    ctx->saved_data["w_total"] = w_total;
    ctx->saved_data["denom"] = denom;
    ctx->saved_data["reduction"] = reduction;
    const std::vector<int64_t> shape = out.sizes().vec();
    return make_dtensor(out,
                        make_spec(spec.mesh(), replicate_all(spec.mesh().ndim()),
                                  TensorMeta{shape, default_strides(shape), out.scalar_type()}));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(6);
    if (!grads[0].defined()) return result;
    const at::Tensor logp = ctx->get_saved_variables()[0];
    const DTensorSpec& spec = spec_of(logp);
    const int64_t c = logp.dim() >= 2 ? 1 : 0;
    const at::Tensor keep = ctx->saved_data["keep"].toTensor();
    const at::Tensor w_local = ctx->saved_data["w_local"].toTensor();
    const at::Tensor w_total = ctx->saved_data["w_total"].toTensor();
    const int64_t reduction = ctx->saved_data["reduction"].toInt();

    // The gradient of each position's smooth (the loss is Replicate, so is its gradient).
    at::Tensor g = whole(grads[0]);
    if (reduction == at::Reduction::Mean) g = g / ctx->saved_data["denom"].toTensor();
    g = g.expand(keep.sizes()).masked_fill(keep.logical_not(), 0);

    // d smooth / d x_j = softmax_j * sum(w) - w_j: local to this rank's classes.
    const at::Tensor lp = local_tensor(logp);
    const at::Tensor p = lp.exp() * w_total;
    const at::Tensor grad = g.unsqueeze(c) * (w_local.defined() ? p - w_local : p - 1);
    const std::vector<int64_t> shape = spec.shape();
    result[0] =
        make_dtensor(grad.contiguous(),
                     make_spec(spec.mesh(), spec.placements(),
                               TensorMeta{shape, default_strides(shape), grad.scalar_type()}));
    return result;
  }
};

// cross_entropy_loss at the DTensor autograd key: label smoothing under loss_parallel here,
// everything else the composite at::cross_entropy (log_softmax + nll_loss [+ smoothing ops]).
at::Tensor cross_entropy_loss(const at::Tensor& self, const at::Tensor& target,
                              const std::optional<at::Tensor>& weight, int64_t reduction,
                              c10::SymInt ignore_index, double label_smoothing) {
  // Class-probability targets (same shape as the input) are not supported by loss_parallel.
  if (!(label_smoothing > 0.0 && loss_parallel_enabled() && is_dtensor(self) &&
        self.sizes() != target.sizes())) {
    return at::native::cross_entropy_loss_symint(self, target, weight, reduction,
                                                 std::move(ignore_index), label_smoothing);
  }
  TORCH_CHECK(label_smoothing <= 1.0,
              "label_smoothing must be between 0.0 and 1.0. Got: ", label_smoothing);
  const int64_t c = self.dim() == 1 ? 0 : 1;
  const at::Tensor logp = at::log_softmax(self, c, self.scalar_type());
  const at::Tensor nll = at::nll_loss_nd_symint(logp, target, weight, reduction, ignore_index);
  const at::Tensor no_weight = at::empty({0}, self.options().device(c10::kCPU).dtype(at::kDouble));
  const at::Tensor smooth = SmoothingTerm::apply(
      self, logp, target, weight.has_value() && weight->defined() ? *weight : no_weight, reduction,
      ignore_index.expect_int());
  return (1 - label_smoothing) * nll +
         smooth * (label_smoothing / static_cast<double>(self.size(c)));
}

// The DTensor decomposition of cross_entropy_loss (run at the DTensor autograd key in place of
// LibTorch's, dispatch::register_decomposition).
const bool registered = [] {
  dispatch::register_decomposition("aten::cross_entropy_loss", [](std::vector<c10::IValue>& s) {
    const size_t a = s.size() - 6;
    at::Tensor loss = cross_entropy_loss(s[a].toTensor(), s[a + 1].toTensor(),
                                         s[a + 2].toOptional<at::Tensor>(), s[a + 3].toInt(),
                                         s[a + 4].toSymInt(), s[a + 5].toDouble());
    torch::jit::drop(s, 6);
    s.emplace_back(std::move(loss));
  });
  return true;
}();

}  // namespace
}  // namespace dtensor::tp::detail
