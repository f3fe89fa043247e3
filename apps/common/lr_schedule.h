#pragma once
// Learning rate per step: linear warmup from 0 to `lr` over `warmup` steps, then cosine decay
// from `lr` to `min_lr` at the last step (as nanoGPT and torchtitan schedule it).
#include <cstdint>

namespace dtensor::train {

struct LrSchedule {
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup = 0;
  int64_t total_steps = 1;

  // The rate for 0-based `step`: (step+1)/warmup * lr during warmup, then
  // min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2 with progress 0 -> 1 over the
  // remaining steps, and min_lr from total_steps on.
  double at(int64_t step) const;
};

}  // namespace dtensor::train
