// parallelize, parallelize_pipeline: see include/dtensor/models/parallelize.h.
#include "dtensor/models/parallelize.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>

#include "dtensor/fsdp/replicate.h"

namespace dtensor::models {
namespace {

// TP where the mesh has a "tp" dim of more than one rank (a 1-D mesh without names is TP's), as
// torchtitan decides (of one rank too with tensor_parallel_on_one_rank).
std::optional<DeviceMesh> tp_to_apply(const ParallelDims& dims, const ParallelizeOptions& o) {
  std::optional<DeviceMesh> tp = dims.mesh("tp");
  if (tp && tp->size() == 1 && !o.tensor_parallel_on_one_rank) tp.reset();
  return tp;
}

DeviceMesh fsdp_mesh_of(const ParallelDims& dims) {
  std::optional<DeviceMesh> dp = dims.mesh("dp_shard");
  TORCH_CHECK(dp, "parallelize: fully_shard needs a mesh dimension named \"dp\", got ",
              dims.world_mesh->str());
  return *dp;
}

// AC, then the data parallelism "dp" says: FSDP with the blocks as units, then the root with
// what is left; or the root replicated, its gradients averaged after each backward.
void checkpoint_and_shard(TransformerImpl& root, const ParallelDims& dims,
                          const ParallelizeOptions& o) {
  ac::apply_ac<TransformerBlockImpl>(root, o.ac, o.ac_options);
  if (!o.fully_shard) {
    // (A "dp" of one rank has nothing to average.)
    if (const auto dp = dims.mesh("dp_replicate"); dp && dp->size() > 1)
      fsdp::replicate(root, *dp, o.replicate);
    // The cp ranks hold the same parameters and each computes on its slots of the sequence:
    // like data parallelism, their gradients are averaged (each rank's loss scaled to the
    // mean: context_parallel_loss). ParallelDims refuses cp with dp so far.
    if (const auto cp = dims.mesh("cp"); cp && cp->size() > 1)
      fsdp::replicate(root, *cp, o.replicate);
    return;
  }
  const DeviceMesh dp = fsdp_mesh_of(dims);
  fsdp::FullyShardOptions unit = o.fsdp;
  unit.reshard_after_forward = true;
  for (TransformerBlockImpl* block : root.blocks()) fsdp::fully_shard(*block, dp, unit);
  unit.reshard_after_forward = false;
  fsdp::fully_shard(root, dp, unit);
}

// FSDP with context parallelism shards over the dp x cp ranks (torchtitan's dp_shard_cp): the
// cp ranks hold the same parameters, so they shard them too, and FSDP's averaged reduce-scatter
// is the average over cp the losses need (context_parallel_loss). TP and FSDP then run on a
// ("dp", "tp") mesh of the same ranks whose "dp" is dp x cp (new groups: every rank builds it);
// the attention keeps the "cp" dim's groups of `mesh`.
DeviceMesh fold_cp_into_dp(const DeviceMesh& mesh, const ParallelDims& dims) {
  const int64_t tp = dims.tp;
  return DeviceMesh(mesh.device_type(), {mesh.size() / tp, tp}, mesh.ranks(), {"dp", "tp"});
}

}  // namespace

void parallelize(TransformerImpl& model, const DeviceMesh& given_mesh,
                 const ParallelizeOptions& options,
                 const std::function<void(TransformerImpl&)>& after_tensor_parallel) {
  const bool stage = model.is_pipeline_stage();
  TORCH_CHECK(!stage || !options.tp_plan,
              "parallelize: a pipeline stage runs the built-in plan (without sequence "
              "parallelism); tp_plan applies to whole models");
  const ParallelDims given = ParallelDims::from_mesh(given_mesh, options.fully_shard);
  const bool fold = options.fully_shard && given.cp > 1;
  TORCH_CHECK(!fold || given.pp == 1, "parallelize: FSDP over context parallelism (cp=", given.cp,
              ") with pipeline stages is not built yet");
  const DeviceMesh mesh = fold ? fold_cp_into_dp(given_mesh, given) : given_mesh;
  const ParallelDims dims = fold ? ParallelDims::from_mesh(mesh, true) : given;
  if (const auto tp = tp_to_apply(dims, options)) {
    if (options.tp_plan) {
      options.tp_plan(model, *tp);
    } else {
      TensorParallelOptions o = options.tp;
      // A stage's activations cross its boundaries whole, and overlap_comm overlaps
      // sequence-parallel collectives.
      if (stage) o.overlap_comm = false;
      apply_tensor_parallel(model, *tp, o);
    }
  }
  if (after_tensor_parallel) after_tensor_parallel(model);
  checkpoint_and_shard(model, dims, options);
}

std::vector<at::Tensor> TransformerPipeline::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& st : stages)
    for (const auto& p : st->parameters()) out.push_back(p);
  return out;
}

namespace {
bool tied_copy_in(const std::vector<Transformer>& stages, const at::Tensor& param) {
  for (const auto& st : stages)
    if (st->tied_across_stages() && param.is_same(st->output->weight)) return true;
  return false;
}
}  // namespace

bool TransformerPipeline::is_tied_copy(const at::Tensor& param) const {
  return tied_copy_in(stages, param);
}

nn::utils::ClipGradNormOptions TransformerPipeline::clip_options() const {
  nn::utils::ClipGradNormOptions o;
  o.stage_group = pipes.front()->pp_mesh().get_group(0);
  // The stages by value: the options may outlive a moved-from TransformerPipeline.
  o.counted_elsewhere = [stages = stages](const at::Tensor& p) { return tied_copy_in(stages, p); };
  return o;
}

TransformerPipeline parallelize_pipeline(TransformerImpl& whole, const DeviceMesh& mesh,
                                         const ParallelizeOptions& options,
                                         const PipelineOptions& pipeline,
                                         const std::function<void(TransformerImpl& whole)>& fill) {
  TransformerPipeline out;
  out.stages = split_transformer_stages(whole, mesh, pipeline.virtual_stages);
  if (fill) materialize_stages(out.stages, whole, fill);
  std::vector<pp::PipelineStage*> pipes;
  for (auto& st : out.stages) {
    parallelize(*st, mesh, options);
    out.pipes.push_back(make_pipeline_stage(st, mesh));
    pipes.push_back(out.pipes.back().get());
  }
  pp::LossFn loss = pipeline.loss;
  if (!loss)
    loss = [](const at::Tensor& o, const at::Tensor& t) { return token_cross_entropy(o, t); };
  const int64_t m = pipeline.microbatches;
  if (pipeline.schedule == "gpipe") {
    out.schedule = std::make_unique<pp::ScheduleGPipe>(*pipes[0], m, loss);
  } else if (pipeline.schedule == "interleaved") {
    out.schedule = std::make_unique<pp::ScheduleInterleaved1F1B>(pipes, m, loss);
  } else {
    TORCH_CHECK(pipeline.schedule == "1f1b", "parallelize_pipeline: unknown schedule '",
                pipeline.schedule, "': expected gpipe, 1f1b or interleaved");
    TORCH_CHECK(pipes.size() == 1, "parallelize_pipeline: ", pipes.size(),
                " virtual stages per rank need schedule \"interleaved\"");
    out.schedule = std::make_unique<pp::Schedule1F1B>(*pipes[0], m, loss);
  }
  return out;
}

}  // namespace dtensor::models
