#pragma once
// config.json's mixture-of-experts keys as HfMoeConfig (dtensor/models/hf_experts.h), from the
// parsed JSON, for the family table's reader.
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "dtensor/models/hf_moe_config.h"

namespace dtensor::models::detail {

// As read_hf_moe_config, from config.json parsed (`path` names it in errors), for `n_layers`
// layers of architecture `architecture`.
std::optional<HfMoeConfig> parse_hf_moe_config(const nlohmann::json& j, const std::string& path,
                                               const std::string& architecture, int64_t n_layers);

}  // namespace dtensor::models::detail
