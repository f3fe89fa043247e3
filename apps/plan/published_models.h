#pragma once
// The mixture-of-experts models dtensor_plan knows by name (--model), as their published
// config.json files describe them: read through the same Hugging Face config reader that
// --hf-config uses, so that a preset plans as its config.json would.
#include <string>
#include <vector>

#include "dtensor/models/transformer.h"

namespace dtensor::plan {

/// The names: qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, gpt-oss-120b.
const std::vector<std::string>& published_moe_models();

/// The model `name` (one of published_moe_models()); throws naming it otherwise.
models::DecoderConfig published_moe_model(const std::string& name);

}  // namespace dtensor::plan
