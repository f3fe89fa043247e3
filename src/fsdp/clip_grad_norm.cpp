// clip_grad_norm_: see include/dtensor/fsdp/clip_grad_norm.h.
#include "dtensor/fsdp/clip_grad_norm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <limits>
#include <memory>

#include "dtensor/comm/collectives.h"
#include "dtensor/dispatch/implicit_replication.h"
#include "dtensor/fsdp/fully_shard.h"

namespace dtensor::fsdp {

double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                       const ClipGradNormOptions& options) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> others;  // counted DTensors and plain tensors
  bool all_counted_here = true;
  // FSDP shards' squares: [TP shards the parameter, TP replicates it (or there is no TP)].
  at::Tensor squares = at::zeros({2}, at::kDouble);
  std::shared_ptr<comm::ProcessGroup> dp_group, tp_group;
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    if (options.counted_elsewhere && options.counted_elsewhere(p)) {
      all_counted_here = false;
      continue;
    }
    if (!is_fsdp_shard(p)) {
      others.push_back(p);
      continue;
    }
    const ShardInfo info = shard_info(p);
    TORCH_CHECK(!dp_group || dp_group == info.dp_group,
                "fsdp::clip_grad_norm_: the parameters are sharded over different dp groups (",
                dp_group->size(), " and ", info.dp_group->size(),
                " ranks); clip each model's parameters separately");
    dp_group = info.dp_group;
    const bool tp_sharded = info.tp_spec && !info.tp_spec->is_replicated();
    if (tp_sharded && info.tp_spec->mesh().size() > 1) {
      auto group = info.tp_spec->mesh().get_group(0);
      TORCH_CHECK(!tp_group || tp_group == group,
                  "fsdp::clip_grad_norm_: the parameters are tensor-parallel over different "
                  "groups");
      tp_group = std::move(group);
    }
    squares.narrow(0, tp_sharded ? 0 : 1, 1).add_(g.to(at::kDouble).pow(2).sum());
  }
  // The whole model as DTensors and plain tensors: LibTorch's own function, unchanged.
  if (!dp_group && !options.stage_group && all_counted_here) {
    ImplicitReplication plain_gradients_are_replicated;
    return torch::nn::utils::clip_grad_norm_(others, max_norm);
  }
  double total = 0;
  if (!others.empty()) {
    ImplicitReplication plain_gradients_are_replicated;
    const double n =
        torch::nn::utils::clip_grad_norm_(others, std::numeric_limits<double>::infinity());
    total += n * n;
  }
  if (dp_group) {
    squares = comm::all_reduce(squares, ReduceOp::Sum, *dp_group);
    at::Tensor sharded = squares.narrow(0, 0, 1).clone();
    if (tp_group) sharded = comm::all_reduce(sharded, ReduceOp::Sum, *tp_group);
    total += sharded.item<double>() + squares[1].item<double>();
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
