#pragma once
// Where dtensor_generate's model comes from: a dtensor_train checkpoint, a preset with random
// weights, or a Hugging Face checkpoint directory.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/transformer.h"

namespace dtensor::generate_app {

struct ModelSource {
  std::string checkpoint;  // a dtensor_train run or checkpoints directory, or a .safetensors file
  std::string hf_model;    // a Hugging Face checkpoint directory
  std::string preset;      // random weights drawn from `seed`
  uint64_t seed = 0;
  std::string dtype;  // "" (the checkpoint's, float32 for presets), "float32" or "float64"
};

struct LoadedModel {
  models::Transformer model{nullptr};
  std::string description;     // what was loaded, for the header line
  std::string tokenizer_json;  // a Hugging Face tokenizer.json; empty: the byte tokenizer
};

// The checkpoint file `what` names: the file itself, or the newest intact checkpoint of a
// dtensor_train output directory (DIR/checkpoints) or checkpoints directory. Throws naming the
// path when there is none.
std::string resolve_checkpoint(const std::string& what);

// Builds the model, parallelizes it over `mesh` (without sequence parallelism: generate does not
// use it) and loads its weights. Collective.
LoadedModel load_model(const ModelSource& source, const DeviceMesh& mesh);

}  // namespace dtensor::generate_app
