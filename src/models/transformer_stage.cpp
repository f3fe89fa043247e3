// The Llama model split into pipeline stages.
#include "dtensor/models/transformer_stage.h"

#include <ATen/ATen.h>

#include "block_math.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/fsdp/fully_shard.h"
#include "meta_construction.h"

namespace dtensor::models {

TransformerStageImpl::TransformerStageImpl(TransformerImpl& whole, int64_t stage,
                                           int64_t num_stages)
    : config_(whole.config()), stage_(stage), num_stages_(num_stages) {
  TORCH_CHECK(
      !whole.tp_state(),
      "split_transformer_stage: split the model before apply_tensor_parallel (then parallelize "
      "each stage with apply_tensor_parallel(stage, mesh))");
  std::tie(first_layer_, end_layer_) = pp::stage_layer_range(config_.n_layers, stage, num_stages);
  const bool first = stage == 0, last = stage == num_stages - 1;
  if (first) tok_embeddings = register_module("tok_embeddings", whole.tok_embeddings);
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> blocks;
  for (int64_t i = first_layer_; i < end_layer_; ++i)
    blocks.emplace_back(std::to_string(i), whole.layers[i]);
  layers = register_module("layers", torch::nn::ModuleDict(blocks));
  if (last) {
    norm = register_module("norm", whole.norm);
    if (config_.tie_embeddings && !first) {
      // The embedding lives on the first stage: this stage gets a copy of its own, kept equal
      // by summing the two stages' gradients (make_pipeline_stage ties them).
      const at::Tensor& embedding = whole.tok_embeddings->weight;
      const auto make_output = [this] {
        output = dtensor::nn::Linear(
            torch::nn::LinearOptions(config_.dim, config_.vocab_size).bias(false));
      };
      if (embedding.is_meta()) {  // shapes only, like the whole: init_stage_weights fills it
        detail::MetaConstructionGuard meta;
        make_output();
      } else {
        // Linear's own initialisation draws from the default generator: restore it, so that
        // this rank's later random numbers (a batch drawn alike on every rank) stay the others'.
        at::Generator gen = at::detail::getDefaultCPUGenerator();
        const at::Tensor state = gen.get_state();
        make_output();
        gen.set_state(state);
      }
      output->to(embedding.scalar_type());
      if (!embedding.is_meta()) {
        at::NoGradGuard no_grad;
        output->weight.copy_(embedding);
      }
      output = register_module("output", output);
      tied_across_stages_ = true;
    } else {
      output = register_module("output", whole.output);
    }
  }
  for (int64_t i = first_layer_; i < end_layer_; ++i)
    rope_tables_.push_back(
        whole.rope(config_.max_seq_len, at::TensorOptions().dtype(at::kDouble), i));
}

at::Tensor TransformerStageImpl::forward(const at::Tensor& input) {
  return call_forward(
      [this](const at::Tensor& input) {
        at::Tensor h = input;
        if (!tok_embeddings.is_empty()) {
          TORCH_CHECK(input.dim() == 2, "TransformerStage ", stage_,
                      ": the first stage takes tokens (batch, seqlen), got ", input.sizes());
          h = detail::scale_embeddings(tok_embeddings(input), config_.dim,
                                       config_.scale_embeddings);
        } else {
          TORCH_CHECK(input.dim() == 3 && input.size(2) == config_.dim, "TransformerStage ", stage_,
                      ": expected hidden states (batch, seqlen, ", config_.dim, "), got ",
                      input.sizes());
        }
        const at::Tensor& local = is_dtensor(h) ? local_tensor(h) : h;
        const int64_t seqlen = local.size(1);
        TORCH_CHECK(seqlen <= config_.max_seq_len, "sequence length ", seqlen,
                    " exceeds max_seq_len=", config_.max_seq_len);
        size_t i = 0;
        for (const auto& item : *layers) {
          const at::Tensor rope = rope_tables_[i++].slice(0, 0, seqlen).to(local.options());
          h = item.value()->as<TransformerBlockImpl>()->forward(h, rope);
        }
        if (!output.is_empty()) h = detail::softcap(output(norm(h)), config_.final_logit_softcap);
        return h;
      },
      input);
}

TransformerStage split_transformer_stage(TransformerImpl& whole, const DeviceMesh& mesh) {
  auto pp_mesh = pp::get_pp_mesh(mesh);
  TORCH_CHECK(pp_mesh, "split_transformer_stage needs a mesh with a dimension named \"pp\", got ",
              mesh.str());
  const int64_t pp = pp_mesh->size();
  return TransformerStage(whole, pp_mesh->get_local_rank(), pp);
}

std::vector<TransformerStage> split_transformer_stages(TransformerImpl& whole,
                                                       const DeviceMesh& mesh,
                                                       int64_t virtual_stages) {
  auto pp_mesh = pp::get_pp_mesh(mesh);
  TORCH_CHECK(pp_mesh, "split_transformer_stages needs a mesh with a dimension named \"pp\", got ",
              mesh.str());
  TORCH_CHECK(virtual_stages >= 1, "split_transformer_stages: virtual_stages must be >= 1, got ",
              virtual_stages);
  const int64_t pp = pp_mesh->size();
  std::vector<TransformerStage> out;
  for (int64_t k = 0; k < virtual_stages; ++k)
    out.emplace_back(whole, k * pp + pp_mesh->get_local_rank(), virtual_stages * pp);
  return out;
}

void materialize_stages(const std::vector<TransformerStage>& stages, TransformerImpl& whole,
                        const std::function<void(TransformerImpl& whole)>& fill) {
  const auto allocate = [](const std::string&, const at::Tensor& local, c10::Device device) {
    return at::empty(local.sizes(), local.options().device(device));
  };
  bool tied_copy = false;
  for (const auto& st : stages) {
    TORCH_CHECK(!st->tp_state, "materialize_stages: call it before apply_tensor_parallel");
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

void init_stage_weights(const std::vector<TransformerStage>& stages, TransformerImpl& whole,
                        uint64_t seed) {
  materialize_stages(stages, whole, [seed](TransformerImpl& w) { w.init_weights(seed); });
}

std::unique_ptr<pp::PipelineStage> make_pipeline_stage(TransformerStage stage,
                                                       const DeviceMesh& mesh) {
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
