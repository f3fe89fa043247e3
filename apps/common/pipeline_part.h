#pragma once
// dtensor_train --pp: this rank's pipeline stages (one, or --virtual-stages of them interleaved) of
// the model (dtensor/models/transformer_stage.h) with tensor parallelism inside it (no sequence
// parallelism), its schedule, the forward-only passes of evaluation and generation, and the
// exchange of the whole model's state with a plain one-device Trainer for checkpoints. A Trainer
// holds one when pipelined.
#include <ATen/core/Tensor.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "corpus.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/parallelize.h"
#include "dtensor/models/residual_dropout.h"
#include "dtensor/models/transformer_stage.h"
#include "dtensor/pp/pipeline.h"
#include "run_config.h"

namespace dtensor::train {

class PipelinePart {
 public:
  // models::parallelize_pipeline: splits `whole` (built on the meta device) over the "pp"
  // dimension of `mesh` ([pp, tp] or [pp, dp, tp]), gives this rank's stages memory and the
  // values whole.init_weights(seed) draws or --hf's (a plan keeps them shapes), and parallelizes
  // them as parallelize_options(config) says.
  PipelinePart(models::TransformerImpl& whole, const RunConfig& config, const DeviceMesh& mesh);

  // This rank's stages, as submodules "0", "1", ... (its v virtual stages in order).
  torch::nn::Module& stage() { return *chunks_; }
  const pp::PipelineStage& pipe() const { return *pipeline_.pipes.front(); }
  // The last stage's copy of a tied embedding: its gradient equals the first stage's after the
  // step, so the global gradient norm counts it once (on the first stage).
  bool is_tied_copy(const at::Tensor& param) const { return pipeline_.is_tied_copy(param); }
  // nn::utils::clip_grad_norm_'s options for this rank's stages.
  nn::utils::ClipGradNormOptions clip_options() const { return pipeline_.clip_options(); }

  struct StepResult {
    double loss = 0;    // mean over the batch, on every rank
    double bubble = 0;  // mean over the stages of the share of the schedule's step spent idle
  };
  // One forward and backward pass of the schedule over `batch` (gradients accumulate), its rows
  // from `key.first_row` on in the global batch for residual dropout; returns the last stage's
  // mean loss (undefined on the other stages).
  at::Tensor run_schedule(const Batch& batch, const models::DropoutKey& key);
  // The step's loss and bubble on every rank, from run_schedule's result (one all_reduce).
  StepResult step_values(const at::Tensor& loss);
  // The last run_schedule's micro-batch losses in order, as doubles (empty but on the last stage).
  std::vector<double> microbatch_losses() const;

  // The last stage's logits for `tokens` (read on the first stage), without gradients
  // (undefined on the other stages): pp::Schedule::eval of the batch as one micro-batch.
  at::Tensor forward(const at::Tensor& tokens);
  // The last stage's `v` on every stage.
  double from_last_stage(double v);

  // Checkpoints. The names are the whole model's (layers.K with the global K). gather_into
  // fills `full` (a plain one-device model) and `full_opt` (AdamW built on it alike) with the
  // whole model's parameters and AdamW state, on every rank; scatter_from copies this stage's
  // part of them into the stage's parameters and `own_opt`.
  void gather_into(torch::optim::AdamW& own_opt, models::TransformerImpl& full,
                   torch::optim::AdamW& full_opt);
  void scatter_from(models::TransformerImpl& full, torch::optim::AdamW& full_opt,
                    torch::optim::AdamW& own_opt);

 private:
  // This rank's parameters by their names in the whole model.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;

  RunConfig config_;
  // The stage (of pp x virtual stages) holding each parameter of the whole model, by name.
  std::map<std::string, int64_t> owners_;
  models::TransformerPipeline pipeline_;
  std::shared_ptr<torch::nn::Module> chunks_;
};

}  // namespace dtensor::train
