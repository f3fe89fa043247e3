#pragma once
// Any torch::nn::Sequential as pipeline stages: stage s keeps a contiguous range of its modules
// (split as evenly as stage_layer_range splits blocks), shared with the whole model and named by
// their index in it ("3.weight"), so parameter names, optimizer state and checkpoints are the
// whole model's.
//
//   torch::nn::Sequential whole(torch::nn::Linear(8, 16), torch::nn::Tanh(), ...);
//   auto part = pp::make_sequential_stage(whole, mesh);  // this rank's modules on "pp"
//   pp::Schedule1F1B schedule(*part.stage, 4, loss_fn);
//   torch::optim::AdamW opt(part.module->parameters(), ...);
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>

#include "dtensor/pp/pipeline.h"

namespace dtensor::pp {

/// Modules [first, end) of `whole` as a Sequential that shares them, each under its index in
/// `whole`.
torch::nn::Sequential split_sequential(const torch::nn::Sequential& whole, int64_t first,
                                       int64_t end);

/// This rank's stage of `whole` and the PipelineStage that runs it.
struct SequentialStage {
  torch::nn::Sequential module{nullptr};  ///< This stage's modules.
  std::unique_ptr<PipelineStage> stage;   ///< Runs `module` on the pp dimension.
  int64_t first = 0, end = 0;             ///< The range of `whole`'s modules it holds.
};

/// Stage `pp rank` of `whole` on the "pp" dimension of `mesh` (see get_pp_mesh); throws when
/// `whole` has fewer modules than stages.
SequentialStage make_sequential_stage(const torch::nn::Sequential& whole, const DeviceMesh& mesh);

}  // namespace dtensor::pp
