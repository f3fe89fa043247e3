#include "plan_file.h"

#include <c10/util/Exception.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "dtensor/comm/error_message.h"
#include "dtensor/tp/parse_style.h"

namespace dtensor::train {

PlanFile read_plan_file(const std::string& path) {
  auto bad = [&](const std::string& what) -> std::invalid_argument {
    return std::invalid_argument("--plan " + path + ": " + what);
  };
  std::ifstream in(path);
  if (!in) throw bad("cannot open the file");
  // ordered_json: entries apply in the order the file lists them.
  nlohmann::ordered_json doc;
  try {
    doc = nlohmann::ordered_json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("not valid JSON: ") + e.what());
  }
  if (!doc.is_object() || doc.empty()) {
    throw bad(
        "expected a JSON object of module paths to styles, e.g. "
        "{\"layers.*.attention.wq\": \"ColwiseParallel()\"}");
  }
  PlanFile out;
  out.path = path;
  for (const auto& [key, value] : doc.items()) {
    if (!value.is_string()) {
      throw bad("entry \"" + key +
                "\": the style must be a string such as \"ColwiseParallel()\", got " +
                value.dump());
    }
    const std::string text = value.get<std::string>();
    try {
      out.plan.emplace_back(key, tp::parse_style(text));
    } catch (const std::exception& e) {
      throw bad("entry \"" + key + "\": " + comm::error_message(e));
    }
    out.sequence_parallel = out.sequence_parallel || text.starts_with("SequenceParallel");
  }
  return out;
}

void apply_plan_file(models::TransformerImpl& model, const DeviceMesh& tp_mesh,
                     const PlanFile& plan) {
  try {
    tp::parallelize_module(model, tp_mesh, plan.plan, /*src_data_rank=*/std::nullopt);
  } catch (const std::exception& e) {
    throw std::runtime_error("--plan " + plan.path + ": " + comm::error_message(e));
  }
  if (model.config().tie_embeddings) model.tie_output_to_embedding();
  // Whether the logits come back vocab-sharded is up to the plan's "output" entry;
  // token_cross_entropy handles either.
  model.set_tp_state({tp_mesh, plan.sequence_parallel, /*loss_parallel=*/false, std::nullopt});
}

}  // namespace dtensor::train
