#pragma once
// The parallelisms of a run composed on one named mesh, in KempnerForge's (and torchtitan's)
// order: tensor parallelism over "tp", then activation checkpointing of the blocks, then the data
// parallelism of "dp": FSDP (every block a unit, then the root with what is left: embedding,
// final norm, head) or plain replication (gradients averaged over dp after each backward,
// fsdp::replicate) - for the whole model, or under pipeline parallelism for each of this rank's
// stages, which parallelize_pipeline also cuts from a model built on the meta device and
// schedules over "pp". Which dimension plays which role is ParallelDims' rule
// (dtensor/models/parallel_dims.h), which also validates a layout ahead of a run. dtensor_train,
// dtensor_plan and the tests call these; clip the result's gradients with
// nn::utils::clip_grad_norm_ (dtensor/nn/clip_grad.h), which serves every layout.
//
//   ParallelDims dims{.dp_shard = dp, .tp = tp, .pp = pp, .world_size = pp * dp * tp};
//   DeviceMesh mesh = dims.build_mesh("cpu");       // ("pp", "dp", "tp")
//   Transformer whole = meta_transformer(config);
//   ParallelizeOptions par{.ac = ac::ACMode::full, .fully_shard = true};
//   TransformerPipeline p = parallelize_pipeline(*whole, mesh, par,
//       {.schedule = "interleaved", .virtual_stages = 2, .microbatches = 4},
//       [&](TransformerImpl& w) { w.init_weights(seed); });
//   torch::optim::AdamW opt(p.parameters(), ...);
//   p.schedule->step(tokens, targets);               // this rank's dp slice of the batch
//   for (auto& st : p.stages) reduce_partial_grads(*st);
//   nn::utils::clip_grad_norm_(p.parameters(), 1.0, p.clip_options());
//   opt.step();
//
// Without "pp" in the mesh: build the model (or meta_transformer and fill it after TP), then
// parallelize(*model, mesh, par) on a mesh with "dp" and/or "tp".
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtensor/ac/checkpoint.h"
#include "dtensor/fsdp/fully_shard.h"
#include "dtensor/fsdp/replicate.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/parallel_dims.h"
#include "dtensor/models/transformer.h"
#include "dtensor/models/transformer_stage.h"
#include "dtensor/nn/clip_grad.h"
#include "dtensor/pp/pipeline.h"

namespace dtensor::models {

/// What parallelize applies, besides what the mesh's dims say.
struct ParallelizeOptions {
  /// Tensor parallelism over the mesh's "tp" dim (a 1-D mesh without names is "tp"), with the
  /// built-in plan (or tp.plan). Applied when that dim has more than one rank (as torchtitan
  /// does). Pipeline stages run it without sequence parallelism (their activations cross the
  /// stage boundaries replicated) and without overlap_comm.
  TensorParallelOptions tp;
  /// A function of the caller's own instead of apply_tensor_parallel: called with the model and
  /// the "tp" mesh. Whole models only.
  std::function<void(TransformerImpl& model, const DeviceMesh& tp_mesh)> tp_plan;
  /// Activation checkpointing of the blocks (dtensor/ac/checkpoint.h).
  ac::ACMode ac = ac::ACMode::none;
  ac::ACOptions ac_options;
  /// FSDP over the mesh's "dp" dim (ParallelDims' dp_shard): each block a unit whose parameters
  /// are whole only while it runs (reshard_after_forward), the root a unit that keeps them from
  /// its forward to its backward, which starts right away. Off: the "dp" ranks replicate the
  /// model (dp_replicate), fsdp::replicate averaging its gradients after each backward.
  bool fully_shard = false;
  /// The units' mixed precision and prefetch (reshard_after_forward is set as above).
  fsdp::FullyShardOptions fsdp;
  /// Plain replication's buckets (fsdp::replicate).
  fsdp::ReplicateOptions replicate;
  /// Apply tensor parallelism even where the "tp" dim has one rank: the layout-invariant mode
  /// (dtensor/ops/layout_invariant.h) then takes the same canonical sums on one device as at
  /// TP > 1, so the runs agree bit for bit.
  bool tensor_parallel_on_one_rank = false;
};

/// Parallelizes `model` (the whole model or a pipeline stage of it) over `mesh` in place: TP,
/// then `after_tensor_parallel(model)` (where a checkpoint is read shard-on-read: load_hf_weights
/// reads the slices TP keeps), then AC, then FSDP or replication over "dp".
void parallelize(TransformerImpl& model, const DeviceMesh& mesh, const ParallelizeOptions& options,
                 const std::function<void(TransformerImpl&)>& after_tensor_parallel = {});

/// The pipeline's schedule and micro-batches.
struct PipelineOptions {
  std::string schedule = "1f1b";  ///< gpipe | 1f1b | interleaved
  int64_t virtual_stages = 1;     ///< stages per rank (interleaved)
  int64_t microbatches = 1;       ///< per step, of this rank's dp slice of the batch
  /// The loss of the last stage's output; default token_cross_entropy.
  pp::LossFn loss = {};
};

/// What decides, besides the degrees and the model, whether a layout works: the options the
/// run will parallelize with and the shape of its steps (ParallelDims::validate).
struct TrainingOptions {
  ParallelizeOptions parallelize;      ///< As models::parallelize will get them.
  PipelineOptions pipeline;            ///< Schedule, virtual stages, micro-batches (pp > 1).
  int64_t batch_size = 0;              ///< Rows of a global batch; 0: not checked.
  int64_t seq_len = 0;                 ///< Tokens per row; 0: not checked.
  c10::ScalarType dtype = at::kFloat;  ///< The parameters' dtype.
  /// P of ops::LayoutInvariantMode the run trains in (batches cut into
  /// kLayoutInvariantBatchSegments); 0: off.
  int64_t layout_invariant = 0;
};

/// This rank's part of a pipelined model: its stages (parallelized), their PipelineStages and
/// the schedule that runs them.
struct TransformerPipeline {
  std::vector<Transformer> stages;
  std::vector<std::unique_ptr<pp::PipelineStage>> pipes;
  std::unique_ptr<pp::Schedule> schedule;

  /// The parameters of this rank's stages, in stage order.
  std::vector<at::Tensor> parameters() const;
  /// Whether `param` is the last stage's copy of a tied embedding (its gradient equals the
  /// first stage's after a step, where the norm counts it).
  bool is_tied_copy(const at::Tensor& param) const;
  /// Options of nn::utils::clip_grad_norm_ for these stages: the norm summed over "pp", tied
  /// copies counted once.
  nn::utils::ClipGradNormOptions clip_options() const;
};

/// Cuts this rank's stages from `whole` (built on the meta device: meta_transformer) over the
/// mesh's "pp" dim, gives them memory and values from `fill(whole)` (see materialize_stages;
/// no `fill`: they stay shapes, for a dry run), parallelizes each (parallelize above) and
/// schedules them.
TransformerPipeline parallelize_pipeline(TransformerImpl& whole, const DeviceMesh& mesh,
                                         const ParallelizeOptions& options,
                                         const PipelineOptions& pipeline,
                                         const std::function<void(TransformerImpl& whole)>& fill);

}  // namespace dtensor::models
