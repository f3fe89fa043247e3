#pragma once
// The decoder split into pipeline stages (dtensor/pp/pipeline.h), as torchtitan and KempnerForge
// split theirs: stage s is the model with parts removed (a Transformer built by its stage
// constructor), keeping a range of the blocks, the first stage also the embedding, the last the
// final norm and the output head. Parameter names are the whole model's
// ("layers.2.attention.wq.weight"), so plans, checkpoints and comparisons use the same paths.
//
//   auto mesh = init_device_mesh("cpu", {pp, tp}, {"pp", "tp"});
//   Transformer whole = meta_transformer(config);   // shapes only (dtensor/models/meta_init.h)
//   Transformer stage = split_transformer_stage(*whole, mesh);
//   init_stage_weights({stage}, *whole, seed);      // memory and values for this stage only
//   apply_tensor_parallel(*stage, mesh);            // no sequence parallelism in a stage
//   auto pipe = make_pipeline_stage(stage, mesh);
//   pp::Schedule1F1B schedule(*pipe, M, token_cross_entropy);
//
// Tied embeddings: when the first and the last stage differ, the last stage gets its own copy
// of the embedding as output.weight, and make_pipeline_stage ties the two so that their
// gradients are summed between the stages after every step.
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtensor/models/transformer.h"
#include "dtensor/pp/pipeline.h"

namespace dtensor::models {

/// A pipeline stage is a Transformer with parts removed (its stage constructor); this name stays
/// one release for code written against the former separate class.
using TransformerStage [[deprecated("a pipeline stage is a Transformer: use Transformer")]] =
    Transformer;

/// This rank's stage of `whole` on the "pp" dimension of `mesh` (see pp::get_pp_mesh).
Transformer split_transformer_stage(TransformerImpl& whole, const DeviceMesh& mesh);

/// This rank's `virtual_stages` stages of `whole` for an interleaved schedule: of v * pp
/// stages (blocks split by stage_layer_range), those numbered r, r + pp, ... where r is this
/// rank's pp coordinate (pp::ScheduleInterleaved1F1B's placement).
std::vector<Transformer> split_transformer_stages(TransformerImpl& whole, const DeviceMesh& mesh,
                                                  int64_t virtual_stages);

/// The stage (of `num_stages`, as split_transformer_stage(s) cut them) holding each parameter of
/// `whole`, by its name in the whole model (a tied embedding is the first stage's). Cuts `whole`
/// once more for every stage: call it before parallelizing, as one would split.
std::map<std::string, int64_t> stage_of_parameters(TransformerImpl& whole, int64_t num_stages);

/// Gives memory to the parameters of this rank's `stages` of `whole`, a model built on the meta
/// device (meta_transformer) and cut by split_transformer_stage(s), and their values from
/// `fill(whole)`, which must leave the parameters without memory alone (init_weights and
/// load_hf_weights do): no rank holds the whole model. Call before apply_tensor_parallel and
/// fully_shard, as one would fill the whole model.
void materialize_stages(const std::vector<Transformer>& stages, TransformerImpl& whole,
                        const std::function<void(TransformerImpl& whole)>& fill);
/// materialize_stages with the values whole.init_weights(seed) draws.
void init_stage_weights(const std::vector<Transformer>& stages, TransformerImpl& whole,
                        uint64_t seed);

/// The pipeline stage running `stage` (one of split_transformer_stage or split_transformer_stages)
/// on `mesh`'s pp dimension; ties the embedding copies of the first and the last stage when the
/// model ties its embeddings.
std::unique_ptr<pp::PipelineStage> make_pipeline_stage(Transformer stage, const DeviceMesh& mesh);

}  // namespace dtensor::models
