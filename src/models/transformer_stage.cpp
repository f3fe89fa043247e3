// The decoder split into pipeline stages: each a Transformer with parts removed.
#include "dtensor/models/transformer_stage.h"

#include <ATen/ATen.h>

#include "dtensor/core/dtensor_impl.h"
#include "dtensor/fsdp/fully_shard.h"
#include "dtensor/models/parallel_dims.h"
#include "meta_construction.h"

namespace dtensor::models {

Transformer split_transformer_stage(TransformerImpl& whole, const DeviceMesh& mesh) {
  auto pp_mesh = ParallelDims::from_mesh(mesh, false, "pp").mesh("pp");
  TORCH_CHECK(pp_mesh, "split_transformer_stage needs a mesh with a dimension named \"pp\", got ",
              mesh.str());
  const int64_t pp = pp_mesh->size();
  return Transformer(whole, pp_mesh->get_local_rank(), pp);
}

std::vector<Transformer> split_transformer_stages(TransformerImpl& whole, const DeviceMesh& mesh,
                                                  int64_t virtual_stages) {
  auto pp_mesh = ParallelDims::from_mesh(mesh, false, "pp").mesh("pp");
  TORCH_CHECK(pp_mesh, "split_transformer_stages needs a mesh with a dimension named \"pp\", got ",
              mesh.str());
  TORCH_CHECK(virtual_stages >= 1, "split_transformer_stages: virtual_stages must be >= 1, got ",
              virtual_stages);
  const int64_t pp = pp_mesh->size();
  std::vector<Transformer> out;
  for (int64_t k = 0; k < virtual_stages; ++k)
    out.emplace_back(whole, k * pp + pp_mesh->get_local_rank(), virtual_stages * pp);
  return out;
}

std::map<std::string, int64_t> stage_of_parameters(TransformerImpl& whole, int64_t num_stages) {
  std::map<std::string, int64_t> out;
  for (int64_t s = 0; s < num_stages; ++s) {
    const Transformer stage(whole, s, num_stages);
    for (const auto& p : stage->named_parameters()) {
      // The last stage's copy of a tied embedding is no parameter of the whole model.
      if (stage->tied_across_stages() && p.value().is_same(stage->output->weight)) continue;
      out.emplace(p.key(), s);
    }
  }
  return out;
}

void materialize_stages(const std::vector<Transformer>& stages, TransformerImpl& whole,
                        const std::function<void(TransformerImpl& whole)>& fill) {
  const auto allocate = [](const std::string&, const at::Tensor& local, c10::Device device) {
    return at::empty(local.sizes(), local.options().device(device));
  };
  bool tied_copy = false;
  for (const auto& st : stages) {
    for (const auto& p : st->parameters())
      TORCH_CHECK(!is_dtensor(p), "materialize_stages: call it before apply_tensor_parallel");
    detail::materialize_parameters(*st.ptr(), allocate);
    tied_copy = tied_copy || st->tied_across_stages();
  }
  // The last stage's copy of a tied embedding takes the embedding's value, drawn here for it.
  if (tied_copy) detail::materialize_parameters(*whole.tok_embeddings, allocate);
  // One stage holding both ends uses the whole's head, which must see the new embedding.
  if (whole.config().tie_embeddings) whole.tie_output_to_embedding();
  fill(whole);  // what now has memory, by name
  at::NoGradGuard no_grad;
  for (const auto& st : stages)
    if (st->tied_across_stages()) st->output->weight.copy_(whole.tok_embeddings->weight);
}

void init_stage_weights(const std::vector<Transformer>& stages, TransformerImpl& whole,
                        uint64_t seed) {
  materialize_stages(stages, whole, [seed](TransformerImpl& w) { w.init_weights(seed); });
}

std::unique_ptr<pp::PipelineStage> make_pipeline_stage(Transformer stage, const DeviceMesh& mesh) {
  auto pipe = std::make_unique<pp::PipelineStage>(
      [stage](const at::Tensor& x) mutable { return stage->forward(x); }, mesh,
      stage->stage_index(), stage->num_stages());
  // (The PipelineStage checks that this rank runs the stage in the round-robin placement.)
  // Under fully_shard: the stage's reduce-scatters run after its last micro-batch only.
  if (fsdp::set_requires_gradient_sync(*stage, true) > 0)
    pipe->set_gradient_sync_hook(
        [stage](bool sync) mutable { fsdp::set_requires_gradient_sync(*stage, sync); });
  if (stage->config().tie_embeddings && pipe->num_stages() > 1) {
    if (pipe->is_first())
      pipe->tie_parameter(stage->tok_embeddings->weight, pipe->num_stages() - 1);
    if (pipe->is_last()) pipe->tie_parameter(stage->output->weight, 0);
  }
  return pipe;
}

}  // namespace dtensor::models
