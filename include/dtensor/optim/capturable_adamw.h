#pragma once
// AdamW whose step count and bias corrections live on the parameters' device, updated with
// multi-tensor (`_foreach_*`) ops: a step never reads a value back to the host, so it can be
// captured in a CUDA graph and replayed. torch::optim::AdamW keeps the step count on the host
// and folds 1 - beta^t into host constants, which a replayed graph would freeze at the
// captured step. Same options (torch::optim::AdamWOptions, amsgrad included), same values to
// rounding, same checkpoint entries. See docs/ARCHITECTURE.md, "Optimizers on the device".
#include <ATen/core/Tensor.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <vector>

namespace dtensor::optim {

/// Per-parameter state. `step` is a 0-d float64 tensor on the parameter's (local) device, the
/// number of updates applied; the moments are shaped and placed like the parameter (DTensors
/// for DTensor parameters).
struct CapturableAdamWParamState
    : public torch::optim::OptimizerCloneableParamState<CapturableAdamWParamState> {
  TORCH_ARG(at::Tensor, step);
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, max_exp_avg_sq) = {};
};

/// AdamW (decoupled weight decay, optional AMSGrad) equal to torch::optim::AdamW. Works on
/// plain and DTensor parameters alike: the update is element-wise, so it runs on each
/// parameter's local shard; a gradient whose placements differ from its parameter's (a
/// Partial left by sequence parallelism) is redistributed to them first. The learning rate and
/// betas are read from the options at each step (host numbers: a captured step replays the
/// values it was captured with).
class CapturableAdamW : public torch::optim::Optimizer {
 public:
  explicit CapturableAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                           torch::optim::AdamWOptions defaults = {});
  explicit CapturableAdamW(std::vector<at::Tensor> params,
                           torch::optim::AdamWOptions defaults = {});

  at::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace dtensor::optim
