#include "model_source.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/checkpoint/checkpoint_manager.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/models/meta_init.h"

namespace dtensor::generate_app {

namespace fs = std::filesystem;

std::string resolve_checkpoint(const std::string& what) {
  if (fs::is_regular_file(what)) return what;
  if (!fs::is_directory(what))
    throw std::runtime_error("--checkpoint: no such file or directory '" + what + "'");
  // A dtensor_train output directory keeps its checkpoints in DIR/checkpoints.
  const fs::path dir = fs::is_directory(fs::path(what) / "checkpoints")
                           ? fs::path(what) / "checkpoints"
                           : fs::path(what);
  const checkpoint::CheckpointManager manager(dir.string());
  if (auto latest = manager.latest()) return *latest;
  const auto all = manager.list();
  if (!all.empty()) return all.back().second;
  throw std::runtime_error("--checkpoint: no checkpoint in '" + dir.string() +
                           "' (dtensor_train writes them with --ckpt-every N or --save-final)");
}

namespace {

// The trainer stores its run configuration: {"model": {DecoderConfig}, "train": {"dtype", ...}}.
// A bare DecoderConfig object is accepted too.
void read_config(const std::string& path, const std::string& text, models::DecoderConfig& config,
                 c10::ScalarType& dtype) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("checkpoint '" + path + "': its config metadata is not JSON (" +
                             e.what() + ")");
  }
  if (!j.is_object() || (j.contains("model") && !j["model"].is_object()))
    throw std::runtime_error("checkpoint '" + path +
                             "': expected a config object with a \"model\" object");
  config = models::DecoderConfig::from_json(j.contains("model") ? j["model"].dump() : j.dump());
  dtype = c10::kFloat;
  if (j.contains("train") && j["train"].value("dtype", "float32") == "float64")
    dtype = c10::kDouble;
}

c10::ScalarType parse_dtype(const std::string& s, c10::ScalarType fallback) {
  if (s.empty()) return fallback;
  if (s == "float32") return c10::kFloat;
  if (s == "float64") return c10::kDouble;
  throw std::runtime_error("--dtype: expected float32 or float64, got '" + s + "'");
}

// config.json, model.safetensors[.index.json] and tokenizer.json of a save_pretrained directory;
// each rank reads only the slices it keeps.
LoadedModel load_hf_model(const ModelSource& source, const DeviceMesh& mesh) {
  const fs::path dir = source.hf_model;
  if (!fs::is_directory(dir))
    throw std::runtime_error("--model: no such directory '" + dir.string() + "'");
  models::HfLoadOptions options;
  options.dtype = parse_dtype(source.dtype, c10::kFloat);
  options.tp.sequence_parallel = false;
  auto hf = models::load_hf(dir.string(), mesh, options);
  LoadedModel out{hf.model,
                  "Hugging Face checkpoint " + dir.string() + " (this rank read " +
                      std::to_string(hf.stats.bytes_read) + " of " +
                      std::to_string(hf.stats.checkpoint_bytes) + " weight bytes)",
                  ""};
  if (fs::is_regular_file(dir / "tokenizer.json")) out.tokenizer_json = dir / "tokenizer.json";
  return out;
}

}  // namespace

LoadedModel load_model(const ModelSource& source, const DeviceMesh& mesh) {
  if (!source.hf_model.empty()) return load_hf_model(source, mesh);
  models::DecoderConfig config;
  c10::ScalarType dtype = c10::kFloat;
  std::string path, description;
  if (!source.checkpoint.empty()) {
    path = resolve_checkpoint(source.checkpoint);
    read_config(path, checkpoint::read_checkpoint_metadata(path).config, config, dtype);
    description = "checkpoint " + path;
  } else {
    config = models::DecoderConfig::preset(source.preset);
    description =
        "preset " + source.preset + ", random weights (seed " + std::to_string(source.seed) + ")";
  }
  dtype = parse_dtype(source.dtype, dtype);
  config.validate_tp(mesh.size());
  models::TensorParallelOptions tp;
  tp.sequence_parallel = false;
  // Only this rank's parameters get memory; the checkpoint or the seed fills them.
  LoadedModel out{models::empty_transformer(config, dtype, mesh, tp), description, ""};
  if (path.empty()) {
    out.model->init_weights(source.seed);
  } else {
    checkpoint::load_checkpoint(path, *out.model);
  }
  return out;
}

}  // namespace dtensor::generate_app
