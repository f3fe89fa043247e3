#pragma once
// The pipeline tests' Llama: the tiny preset with 4 layers, and a rank's stages of it with their
// PipelineStages and schedule, its parameters named as in the whole model.
#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "dtensor/models/transformer.h"
#include "dtensor/models/transformer_stage.h"
#include "dtensor/pp/pipeline.h"
#include "support/model_compare.h"

namespace dtensor::testing {

// The tiny preset with a 64-token vocabulary and 4 layers (enough for 4 stages, or 2 with v=2),
// or `n_layers`.
inline models::DecoderConfig tiny_pipeline_llama(bool tied, int64_t n_layers = 4) {
  auto c = models::DecoderConfig::preset("tiny");
  c.vocab_size = 64;
  c.n_layers = n_layers;
  c.tie_embeddings = tied;
  return c;
}

struct LlamaStages {
  std::vector<models::Transformer> stages;
  std::vector<std::unique_ptr<pp::PipelineStage>> pipes;
  std::unique_ptr<pp::Schedule> schedule;

  bool holds_last() const { return pipes.back()->is_last(); }
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> out;
    for (const auto& st : stages)
      for (const auto& p : st->parameters()) out.push_back(p);
    return out;
  }
  // Every parameter of the rank's stages by its name in the whole model: the last stage's copy
  // of a tied embedding is tok_embeddings.weight.
  Params params() const {
    Params out;
    for (const auto& st : stages)
      for (const auto& [name, p] : params_of(*st))
        out[st->tied_across_stages() && name == "output.weight" ? "tok_embeddings.weight" : name] =
            p;
    return out;
  }
};

}  // namespace dtensor::testing
