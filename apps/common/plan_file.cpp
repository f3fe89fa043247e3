#include "plan_file.h"

#include <c10/util/Exception.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "dtensor/tp/parse_style.h"
#include "dtensor/util/error_message.h"

namespace dtensor::train {

namespace {

const char* kFormat =
    "expected {\"sequence_parallel\": true or false, \"plan\": {module path: style, ...}}, "
    "e.g. {\"sequence_parallel\": false, \"plan\": {\"layers.*.attention.wq\": "
    "\"ColwiseParallel()\"}} (dtensor_train --print-plan writes the built-in one)";

}  // namespace

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
  if (!doc.is_object()) throw bad(kFormat);
  for (const auto& [key, value] : doc.items())
    if (key != "sequence_parallel" && key != "plan")
      throw bad("unknown key \"" + key + "\"; " + kFormat);
  // Whether the plan shards the sequence between blocks decides what its input must satisfy;
  // the file says it rather than having it guessed from its styles.
  if (!doc.contains("sequence_parallel") || !doc.at("sequence_parallel").is_boolean())
    throw bad(
        "\"sequence_parallel\" must be true or false (whether the plan shards the "
        "sequence between blocks); " +
        std::string(kFormat));
  if (!doc.contains("plan") || !doc.at("plan").is_object() || doc.at("plan").empty())
    throw bad("\"plan\" must be a non-empty object of module paths to styles; " +
              std::string(kFormat));
  PlanFile out;
  out.path = path;
  out.sequence_parallel = doc.at("sequence_parallel").get<bool>();
  for (const auto& [key, value] : doc.at("plan").items()) {
    if (!value.is_string()) {
      throw bad("entry \"" + key +
                "\": the style must be a string such as \"ColwiseParallel()\", got " +
                value.dump());
    }
    try {
      out.plan.emplace_back(key, tp::parse_style(value.get<std::string>()));
    } catch (const std::exception& e) {
      throw bad("entry \"" + key + "\": " + util::error_message(e));
    }
  }
  return out;
}

std::string plan_file_json(const tp::ParallelizePlan& plan, bool sequence_parallel) {
  nlohmann::ordered_json entries = nlohmann::ordered_json::object();
  for (const auto& [key, style] : plan) entries[key] = style.repr();
  nlohmann::ordered_json doc;
  doc["sequence_parallel"] = sequence_parallel;
  doc["plan"] = entries;
  return doc.dump(2) + "\n";
}

void apply_plan_file(models::TransformerImpl& model, const DeviceMesh& tp_mesh,
                     const PlanFile& plan) {
  // Whether the logits come back vocab-sharded is up to the plan's "output" entry;
  // token_cross_entropy handles either.
  try {
    models::apply_tensor_parallel(model, tp_mesh,
                                  {.sequence_parallel = plan.sequence_parallel,
                                   .src_data_rank = std::nullopt,
                                   .plan = plan.plan,
                                   .ep = 1,
                                   .expert_parallel = {}});
  } catch (const std::exception& e) {
    throw std::runtime_error("--plan " + plan.path + ": " + util::error_message(e));
  }
}

}  // namespace dtensor::train
