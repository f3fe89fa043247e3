#pragma once
// The bundled Llama split into pipeline stages (dtensor/pp/pipeline.h), as torchtitan and
// KempnerForge split theirs: stage s keeps a range of the blocks, the first stage also the
// embedding, the last the final norm and the output head. Parameter names are the whole model's
// ("layers.2.attention.wq.weight"), so plans, checkpoints and comparisons use the same paths.
//
//   auto mesh = init_device_mesh("cpu", {pp, tp}, {"pp", "tp"});
//   Transformer whole = meta_transformer(config);   // shapes only (dtensor/models/meta_init.h)
//   TransformerStage stage = split_transformer_stage(*whole, mesh);
//   init_stage_weights({stage}, *whole, seed);      // memory and values for this stage only
//   apply_tensor_parallel(*stage, mesh);            // no sequence parallelism: see below
//   auto pipe = make_pipeline_stage(stage, mesh);
//   pp::Schedule1F1B schedule(*pipe, M, token_cross_entropy);
//
// Tied embeddings: when the first and the last stage differ, the last stage gets its own copy
// of the embedding as output.weight, and make_pipeline_stage ties the two so that their
// gradients are summed between the stages after every step.
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/moduledict.h>

#include <functional>
#include <memory>
#include <vector>

#include "dtensor/models/transformer.h"
#include "dtensor/pp/pipeline.h"

namespace dtensor::models {

/// One pipeline stage of the Llama model.
class TransformerStageImpl : public dtensor::nn::Module {
 public:
  /// Takes stage `stage` of `num_stages` of `whole` (its blocks by stage_layer_range), sharing
  /// the submodules with it (prefer split_transformer_stage).
  TransformerStageImpl(TransformerImpl& whole, int64_t stage, int64_t num_stages);

  /// First stage: tokens (B, S) int64; others: hidden states (B, S, dim). Returns hidden states,
  /// on the last stage the logits (B, S, vocab) (a vocab-sharded DTensor under loss parallelism).
  at::Tensor forward(const at::Tensor& input);

  const DecoderConfig& config() const { return config_; }  ///< The whole model's configuration.
  int64_t stage_index() const { return stage_; }           ///< Which stage this is.
  int64_t num_stages() const { return num_stages_; }       ///< Of how many.
  int64_t first_layer() const { return first_layer_; }     ///< Index of its first block.
  int64_t end_layer() const { return end_layer_; }         ///< One past its last block.
  /// Whether output.weight is a copy of the embedding tied across stages (see above).
  bool tied_across_stages() const { return tied_across_stages_; }

  dtensor::nn::Embedding tok_embeddings{nullptr};  ///< First stage only.
  torch::nn::ModuleDict layers{nullptr};           ///< Blocks, keyed by their index in the whole.
  dtensor::nn::RMSNorm norm{nullptr};              ///< Last stage only.
  dtensor::nn::Linear output{nullptr};             ///< Last stage only.

  /// Set by apply_tensor_parallel (the TP mesh and whether the logits stay vocab-sharded).
  std::optional<TransformerImpl::TensorParallelState> tp_state;

 private:
  DecoderConfig config_;
  int64_t stage_, num_stages_, first_layer_, end_layer_;
  bool tied_across_stages_ = false;
  std::vector<at::Tensor> rope_tables_;  // of each block, in order (float64, max_seq_len rows)
};
/// Module holder of TransformerStageImpl.
TORCH_MODULE(TransformerStage);

/// This rank's stage of `whole` on the "pp" dimension of `mesh` (see pp::get_pp_mesh).
TransformerStage split_transformer_stage(TransformerImpl& whole, const DeviceMesh& mesh);

/// This rank's `virtual_stages` stages of `whole` for an interleaved schedule: of v * pp
/// stages (blocks split by stage_layer_range), those numbered r, r + pp, ... where r is this
/// rank's pp coordinate (pp::ScheduleInterleaved1F1B's placement).
std::vector<TransformerStage> split_transformer_stages(TransformerImpl& whole,
                                                       const DeviceMesh& mesh,
                                                       int64_t virtual_stages);

/// Gives memory to the parameters of this rank's `stages` of `whole`, a model built on the meta
/// device (meta_transformer) and cut by split_transformer_stage(s), and their values from
/// `fill(whole)`, which must leave the parameters without memory alone (init_weights and
/// load_hf_weights do): no rank holds the whole model. Call before apply_tensor_parallel and
/// fully_shard, as one would fill the whole model.
void materialize_stages(const std::vector<TransformerStage>& stages, TransformerImpl& whole,
                        const std::function<void(TransformerImpl& whole)>& fill);
/// materialize_stages with the values whole.init_weights(seed) draws.
void init_stage_weights(const std::vector<TransformerStage>& stages, TransformerImpl& whole,
                        uint64_t seed);

/// Tensor parallelism inside a stage over the "tp" dimension of `mesh` (get_tp_mesh): the Llama
/// plan without sequence parallelism (options.sequence_parallel is ignored), so activations
/// between blocks, and so at the stage boundaries, are replicated plain tensors. The
/// collectives per block are those of the whole model's plan without SP.
void apply_tensor_parallel(TransformerStageImpl& stage, const DeviceMesh& mesh,
                           TensorParallelOptions options = {});

/// The pipeline stage running `stage` (one of split_transformer_stage or split_transformer_stages)
/// on `mesh`'s pp dimension; ties the embedding copies of the first and the last stage when the
/// model ties its embeddings.
std::unique_ptr<pp::PipelineStage> make_pipeline_stage(TransformerStage stage,
                                                       const DeviceMesh& mesh);

}  // namespace dtensor::models
