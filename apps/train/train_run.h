#pragma once
// The whole command: data, mesh, training loop with progress, metrics, evaluation and
// checkpoints, then the plot, the summary, and the optional sample and TP=1 check.
#include "common/options.h"
#include "dtensor/comm/process_group.h"

namespace dtensor::train {

// Exit status: 0 success, 1 runtime error (thrown), 2 bad options or a model that does not
// split over the ranks, 3 --verify-tp1 found a mismatch, 4 the loss became NaN/inf.
int run_training(const TrainOptions& options, const comm::LaunchEnv& env);

}  // namespace dtensor::train
