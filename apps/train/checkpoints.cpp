#include "checkpoints.h"

#include <filesystem>
#include <stdexcept>

#include "common/trainer.h"

namespace dtensor::train {
namespace {

// Under --pp no rank holds the whole model: every rank reads the checkpoint into a plain
// one-device twin and takes its stage's part of it.
template <typename Load>
auto load_into(Trainer& trainer, Load&& load) {
  if (!trainer.pipelined()) return load(trainer.model(), trainer.optimizer());
  Trainer one(one_device(trainer.config()), std::nullopt);
  auto result = load(one.model(), one.optimizer());
  trainer.load_from_one_device(one);
  return result;
}

Resumed load_newest(const checkpoint::CheckpointManager& manager, Trainer& trainer) {
  auto meta = load_into(trainer, [&](models::TransformerImpl& model, torch::optim::AdamW& opt) {
    return manager.load_latest(model, &opt);
  });
  if (!meta) {
    throw std::runtime_error("--resume: no checkpoint in " + manager.dir() +
                             " (save some with --ckpt-every N or --save-final)");
  }
  return {manager.path_for(meta->step), meta->step};
}

}  // namespace

Resumed resume_training(const std::string& what, const checkpoint::CheckpointManager& manager,
                        Trainer& trainer) {
  if (what == "auto") return load_newest(manager, trainer);
  if (std::filesystem::is_directory(what)) {
    return load_newest(checkpoint::CheckpointManager(what, manager.keep_last()), trainer);
  }
  if (!std::filesystem::exists(what)) {
    throw std::runtime_error("--resume: no such checkpoint file '" + what + "'");
  }
  return {what, load_into(trainer, [&](models::TransformerImpl& model, torch::optim::AdamW& opt) {
                  return checkpoint::load_checkpoint(what, model, &opt);
                }).step};
}

std::string save_training_checkpoint(checkpoint::CheckpointManager& manager, Trainer& trainer,
                                     int64_t step, const std::string& config_json) {
  checkpoint::SaveOptions options;
  options.config = config_json;
  if (trainer.pipelined()) {
    // The whole model under its own names (layers.K with the global K): any layout loads it.
    Trainer one = trainer.gather_to_one_device();
    options.metadata["pipeline_stages"] = std::to_string(trainer.config().pp);
    return manager.save(step, one.model(), &one.optimizer(), options);
  }
  return manager.save(step, trainer.model(), &trainer.optimizer(), options);
}

}  // namespace dtensor::train
