// parallelize, parallelize_pipeline: see include/dtensor/models/parallelize.h.
#include "dtensor/models/parallelize.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>

namespace dtensor::models {
namespace {

// The dim of `mesh` named `name` as a 1-D mesh (the mesh itself when it is 1-D and so named).
std::optional<DeviceMesh> mesh_dim_named(const DeviceMesh& mesh, const std::string& name) {
  const auto& names = mesh.dim_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) return std::nullopt;
  return mesh.ndim() == 1 ? mesh : mesh[name];
}

// TP where the mesh has a "tp" dim (get_tp_mesh) of more than one rank, as torchtitan decides
// (of one rank too with tensor_parallel_on_one_rank).
std::optional<DeviceMesh> tp_to_apply(const DeviceMesh& mesh, const ParallelizeOptions& o) {
  std::optional<DeviceMesh> tp = get_tp_mesh(mesh);
  if (tp && mesh.ndim() == 1 && mesh.has_dim_names() && mesh.dim_names()[0] != "tp")
    tp.reset();  // a 1-D mesh named otherwise ("dp", "pp") is not TP's
  if (tp && tp->size() == 1 && !o.tensor_parallel_on_one_rank) tp.reset();
  return tp;
}

DeviceMesh fsdp_mesh_of(const DeviceMesh& mesh) {
  std::optional<DeviceMesh> dp = mesh_dim_named(mesh, "dp");
  TORCH_CHECK(dp, "parallelize: fully_shard needs a mesh dimension named \"dp\", got ", mesh.str());
  return *dp;
}

// AC, then FSDP: the blocks `blocks` as units, then `root` with what is left.
void checkpoint_and_shard(torch::nn::Module& root, const std::vector<torch::nn::Module*>& blocks,
                          const DeviceMesh& mesh, const ParallelizeOptions& o) {
  ac::apply_ac<TransformerBlockImpl>(root, o.ac, o.ac_options);
  if (!o.fully_shard) return;
  const DeviceMesh dp = fsdp_mesh_of(mesh);
  fsdp::FullyShardOptions unit = o.fsdp;
  unit.reshard_after_forward = true;
  for (torch::nn::Module* block : blocks) fsdp::fully_shard(*block, dp, unit);
  unit.reshard_after_forward = false;
  fsdp::fully_shard(root, dp, unit);
}

}  // namespace

void parallelize(TransformerImpl& model, const DeviceMesh& mesh, const ParallelizeOptions& options,
                 const std::function<void(TransformerImpl&)>& after_tensor_parallel) {
  if (const auto tp = tp_to_apply(mesh, options)) {
    if (options.tp_plan) {
      options.tp_plan(model, *tp);
    } else {
      apply_tensor_parallel(model, *tp, options.tp);
    }
  }
  if (after_tensor_parallel) after_tensor_parallel(model);
  std::vector<torch::nn::Module*> blocks;
  for (const auto& block : *model.layers) blocks.push_back(block.get());
  checkpoint_and_shard(model, blocks, mesh, options);
}

void parallelize(TransformerStageImpl& stage, const DeviceMesh& mesh,
                 const ParallelizeOptions& options) {
  TORCH_CHECK(!options.tp_plan,
              "parallelize: a pipeline stage runs the built-in plan (without sequence "
              "parallelism); tp_plan applies to whole models");
  if (const auto tp = tp_to_apply(mesh, options)) {
    TensorParallelOptions o = options.tp;
    o.sequence_parallel = false;  // activations cross the stage boundaries replicated
    o.overlap_comm = false;       // it overlaps sequence-parallel collectives
    apply_tensor_parallel(stage, *tp, o);
  }
  std::vector<torch::nn::Module*> blocks;
  for (const auto& item : *stage.layers) blocks.push_back(item.value().get());
  checkpoint_and_shard(stage, blocks, mesh, options);
}

std::vector<at::Tensor> TransformerPipeline::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& st : stages)
    for (const auto& p : st->parameters()) out.push_back(p);
  return out;
}

namespace {
bool tied_copy_in(const std::vector<TransformerStage>& stages, const at::Tensor& param) {
  for (const auto& st : stages)
    if (st->tied_across_stages() && param.is_same(st->output->weight)) return true;
  return false;
}
}  // namespace

bool TransformerPipeline::is_tied_copy(const at::Tensor& param) const {
  return tied_copy_in(stages, param);
}

fsdp::ClipGradNormOptions TransformerPipeline::clip_options() const {
  fsdp::ClipGradNormOptions o;
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
