#pragma once
// One training setup: the model (tensor-parallel over a mesh, or plain LibTorch on one
// device), AdamW with decoupled weight decay on the matrices only, the learning-rate schedule
// and gradient clipping. The TP run and the single-device check are both a Trainer, so they
// run exactly the same steps.
#include <torch/optim/adamw.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>

#include "corpus.h"
#include "dtensor/cp/context_parallel.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/parallel_dims.h"
#include "dtensor/models/residual_dropout.h"
#include "dtensor/models/transformer.h"
#include "dtensor/ops/layout_invariant.h"
#include "run_config.h"

namespace dtensor::train {

struct StepStats {
  double loss = 0;       // mean over the global batch, equal on every rank
  double grad_norm = 0;  // global L2 norm before clipping
  double lr = 0;
  // --pp: the share of the pipeline schedule's step the stages spent not computing (waiting on
  // receives, sends and the tied-gradient swap), their mean; NaN without --pp.
  double bubble = std::numeric_limits<double>::quiet_NaN();
  // With mixture-of-experts layers: the step's auxiliary (load-balancing) loss, mean over dp,
  // and the tokens routed to each expert (E), summed over the sparse layers and the global
  // batch; NaN and undefined without them.
  double aux_loss = std::numeric_limits<double>::quiet_NaN();
  at::Tensor tokens_per_expert;
};

class PipelinePart;

// The ranks of a run as a mesh (models::ParallelDims::build_mesh: "pp", "dp" where there are
// more than one, then "tp"), with local shards on `device_type`.
DeviceMesh make_train_mesh(const RunConfig& config, const std::string& device_type = "cpu");

// Bytes one rank holds for each kind of training state (its shards under TP or FSDP).
struct StateBytes {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;  // AdamW's moments
};

class Trainer {
 public:
  // `mesh`: all ranks, dims named "pp", "dp", "tp" (make_train_mesh's); nullopt: plain LibTorch.
  Trainer(const RunConfig& config, std::optional<DeviceMesh> mesh);

  // One optimizer step on `global_batch` (this rank's dp slice of it is used) at 0-based
  // `step`, which selects the learning rate.
  StepStats train_step(int64_t step, const Batch& global_batch);

  // The part of train_step whose collectives do not depend on values (dtensor_plan runs it on
  // meta tensors): zeroing the gradients, the forward and backward passes (the pipeline
  // schedule under --pp) and the gradient reductions. train_step then clips the gradients by
  // their global norm, steps the optimizer and reduces the loss. Returns this rank's loss
  // tensor (under --pp the last stage's mean, undefined on the other stages).
  at::Tensor forward_backward(const Batch& global_batch);

  // Mean loss over `n_batches` validation batches, without gradients.
  double evaluate(const BatchSampler& val, int64_t n_batches);

  // Up to `n_tokens` tokens continuing `prompt`, sampled with temperature by the library's
  // sampler (models::sample_next_tokens, seeded by (seed, step): the same on every rank, so all
  // ranks feed the same tokens), among the ids [0, decodable) the tokenizer can decode.
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, int64_t n_tokens,
                                double temperature, uint64_t seed, int64_t decodable = 256);

  // The whole model; not under --pp, where no rank holds it (see pipelined()).
  models::TransformerImpl& model();
  // What trains: the whole model, or under --pp this rank's stages.
  torch::nn::Module& module();
  torch::optim::AdamW& optimizer() { return *optimizer_; }
  const RunConfig& config() const { return config_; }
  bool distributed() const { return mesh_.has_value(); }
  bool pipelined() const { return pp_ != nullptr; }

  // --pp checkpoints (collective): the whole model and its AdamW state, under the whole model's
  // names, in a plain one-device Trainer on every rank; and back from one.
  Trainer gather_to_one_device();
  void load_from_one_device(Trainer& one);

  // Bytes this rank holds for the parameters, their gradients and AdamW's two moments (this
  // rank's shards under TP or FSDP), counted from the tensors after a step.
  int64_t state_bytes_per_rank() const;
  // Bytes of this rank's parameters alone (its shards under TP or FSDP).
  int64_t parameter_bytes_per_rank() const;
  // The same, by kind.
  StateBytes state_bytes() const;

 private:
  at::Tensor dp_slice(const at::Tensor& t) const;
  // The global batch row this rank's dp slice starts at.
  int64_t dp_first_row() const;
  // Residual dropout's key for this step's rows from `first_row` on (models/residual_dropout.h):
  // the masks depend on the seed, the step and the global row, not on the layout.
  models::DropoutKey dropout_key(int64_t first_row) const;
  // The data-parallel dim of the mesh (dims_' role "dp"); nullopt without data parallelism.
  std::optional<DeviceMesh> dp_mesh() const;
  double clip_grad_norm(double max_norm);  // returns the global norm before clipping
  double mean_over_dp(double v) const;
  // --cp: the scope this rank runs `batch` context-parallel in (its layout: balanced per
  // document with --pack-documents, head-tail otherwise), or nullptr without --cp.
  std::unique_ptr<cp::ContextParallelScope> context_parallel(const Batch& batch) const;
  // The loss of `batch` from its logits: under --cp this rank's share (context_parallel_loss),
  // else models::training_loss.
  at::Tensor loss_of(const Batch& batch, const at::Tensor& logits) const;
  // This rank's part of a per-token tensor of the batch: its dp rows, or inside a
  // context_parallel scope its slots of the layout (padding `pad`).
  at::Tensor local_part(const at::Tensor& t, double pad = 0) const;
  // The mean of `v` over the cp ranks (each holds its share of the loss); v without --cp.
  double mean_over_cp(double v) const;
  // Keeps the last forward's auxiliary loss and tokens per expert for the step's stats.
  void record_routing();
  // --layout-invariant: this rank's segments of the global batch (kLayoutInvariantBatchSegments
  // in all, split over dp), each a forward and backward of its own.
  std::vector<Batch> invariant_segments(const Batch& global_batch) const;
  at::Tensor invariant_forward_backward(const Batch& global_batch);
  // --layout-invariant: the mode's guard for a step, an evaluation or a generation (nullptr:
  // off).
  std::unique_ptr<ops::LayoutInvariantMode> layout_invariant_mode() const;

  RunConfig config_;
  std::optional<DeviceMesh> mesh_;
  models::ParallelDims dims_;  // the roles of mesh_'s dims
  models::Transformer model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  struct Routing {
    double aux_loss = 0;
    at::Tensor tokens_per_expert;  // undefined without experts
  } routing_;
  std::vector<at::Tensor> params_;
  std::shared_ptr<PipelinePart> pp_;  // --pp: this rank's stage, its schedule
  int64_t step_ = 0;                  // the step train_step runs (dropout's key)
};

}  // namespace dtensor::train
