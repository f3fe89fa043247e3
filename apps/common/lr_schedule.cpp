#include "lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace dtensor::train {

double LrSchedule::at(int64_t step) const {
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const int64_t decay_steps = total_steps - warmup;
  if (decay_steps <= 1) return step < total_steps ? lr : min_lr;
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay_steps - 1));
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace dtensor::train
