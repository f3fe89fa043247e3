#pragma once
// Training checkpoints: model and AdamW state as global tensors under the whole model's names
// (they load at any TP degree and any --pp split; a pipelined run gathers its stages first)
// in DIR/checkpoints through checkpoint::CheckpointManager (step files, a "latest" pointer, the
// newest --keep-ckpts kept). The batches are a function of (seed, step) and so is the
// learning rate, so the step count is the only other state a resumed run needs.
#include <cstdint>
#include <memory>
#include <string>

#include "dtensor/checkpoint/checkpoint_manager.h"

namespace dtensor::train {

class Trainer;

struct Resumed {
  std::string path;  // the file loaded
  int64_t step = 0;  // optimizer steps it had done
};

// --resume: "auto" loads the newest intact checkpoint of `manager`; a directory, the newest
// there; anything else is a checkpoint file. Throws when there is none.
Resumed resume_training(const std::string& what, const checkpoint::CheckpointManager& manager,
                        Trainer& trainer);

// Collective (every rank calls it). Returns the file written.
std::string save_training_checkpoint(checkpoint::CheckpointManager& manager, Trainer& trainer,
                                     int64_t step, const std::string& config_json);

}  // namespace dtensor::train
