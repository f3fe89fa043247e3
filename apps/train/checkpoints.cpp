#include "checkpoints.h"

#include <filesystem>
#include <stdexcept>

#include "trainer.h"

namespace dtensor::train {
namespace {

Resumed load_newest(const checkpoint::CheckpointManager& manager, Trainer& trainer) {
  auto meta = manager.load_latest(trainer.model(), &trainer.optimizer());
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
  return {what, checkpoint::load_checkpoint(what, trainer.model(), &trainer.optimizer()).step};
}

std::string save_training_checkpoint(checkpoint::CheckpointManager& manager, Trainer& trainer,
                                     int64_t step, const std::string& config_json) {
  checkpoint::SaveOptions options;
  options.config = config_json;
  return manager.save(step, trainer.model(), &trainer.optimizer(), options);
}

}  // namespace dtensor::train
