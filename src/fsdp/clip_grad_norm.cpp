// clip_grad_norm_: see include/dtensor/fsdp/clip_grad_norm.h.
#include "dtensor/fsdp/clip_grad_norm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <limits>
#include <memory>

#include "dtensor/comm/collectives.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/dispatch/implicit_replication.h"
#include "dtensor/fsdp/fully_shard.h"

namespace dtensor::fsdp {
namespace {

// Squared gradient sums, one per set of groups they are summed over: the mesh dims a
// gradient's placements shard it over (more than one rank); none for a replicated or plain one.
struct SquareSums {
  struct Bucket {
    std::vector<std::shared_ptr<comm::ProcessGroup>> over;
    at::Tensor sum = at::zeros({}, at::kDouble);
  };
  std::vector<Bucket> buckets;

  void add(const at::Tensor& grad) {
    std::vector<std::shared_ptr<comm::ProcessGroup>> over;
    at::Tensor local = grad;
    if (is_dtensor(grad)) {
      const DTensorSpec& spec = spec_of(grad);
      TORCH_CHECK(!spec.has_partial(), "fsdp::clip_grad_norm_: a gradient has placements ",
                  to_string(spec.placements()),
                  "; reduce Partial gradients first (models::reduce_partial_grads)");
      for (int64_t d = 0; d < spec.mesh().ndim(); ++d)
        if (spec.placements()[d].is_shard() && spec.mesh().size(d) > 1)
          over.push_back(spec.mesh().get_group(d));
      local = local_tensor(grad);
    }
    Bucket* b = nullptr;
    for (auto& x : buckets)
      if (x.over == over) b = &x;
    if (!b) b = &buckets.emplace_back(Bucket{std::move(over)});
    b->sum.add_(local.to(at::kDouble).pow(2).sum());
  }

  // The global sum of squares: per group (in the order first met, the same on every rank of
  // it), one all_reduce of the buckets summed over it.
  double total() {
    std::vector<std::shared_ptr<comm::ProcessGroup>> groups;
    for (const auto& b : buckets)
      for (const auto& g : b.over)
        if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
    for (const auto& g : groups) {
      std::vector<Bucket*> in;
      for (auto& b : buckets)
        if (std::find(b.over.begin(), b.over.end(), g) != b.over.end()) in.push_back(&b);
      std::vector<at::Tensor> sums;
      for (auto* b : in) sums.push_back(b->sum);
      const at::Tensor reduced = comm::all_reduce(at::stack(sums), ReduceOp::Sum, *g);
      for (size_t i = 0; i < in.size(); ++i) in[i]->sum = reduced[static_cast<int64_t>(i)];
    }
    double t = 0;
    for (const auto& b : buckets) t += b.sum.item<double>();
    return t;
  }
};

}  // namespace

double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                       const ClipGradNormOptions& options) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> counted;
  bool all_counted_here = true;
  bool any_shard = false;
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    if (options.counted_elsewhere && options.counted_elsewhere(p)) {
      all_counted_here = false;
      continue;
    }
    counted.push_back(p);
    any_shard = any_shard || is_fsdp_shard(p);
  }
  double total = 0;
  if (any_shard) {
    // FSDP's leaves live on their own meshes ("dp", or (tp, dp)): their squares are summed over
    // the groups their placements shard them over.
    SquareSums sums;
    for (const at::Tensor& p : counted) sums.add(p.grad());
    total = sums.total();
  } else {
    // DTensors (one mesh) and plain tensors: LibTorch's own function, whose DTensor norms
    // reduce a pending p-norm over the sharded dims (and follow the layout-invariant mode).
    ImplicitReplication plain_gradients_are_replicated;
    if (!options.stage_group && all_counted_here)
      return torch::nn::utils::clip_grad_norm_(counted, max_norm);
    if (!counted.empty()) {
      const double n =
          torch::nn::utils::clip_grad_norm_(counted, std::numeric_limits<double>::infinity());
      total = n * n;
    }
  }
  if (options.stage_group) {
    total = comm::all_reduce(at::full({1}, total, at::kDouble), ReduceOp::Sum, *options.stage_group)
                .item<double>();
  }
  const double norm = std::sqrt(total);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1)
    for (auto& g : grads) g.mul_(coef);
  return norm;
}

}  // namespace dtensor::fsdp
