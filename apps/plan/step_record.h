#pragma once
// One training step of a dtensor_train Trainer, recorded: its collectives (as CommDebugMode
// counts them, with the phase of each), its memory by an allocator's accounting, and the state
// it leaves. dtensor_plan runs it on meta tensors in a simulated world (simulate.h); the tests
// run the same function on real tensors over Gloo and compare.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/corpus.h"
#include "common/counting_allocator.h"
#include "common/trainer.h"
#include "dtensor/comm/comm_debug_mode.h"

namespace dtensor::plan {

using train::CountingAllocator;

// One collective of the step: CommDebugMode's record and the phase it ran in.
struct StepCollective {
  CommRecord record;
  std::string phase;  // "forward" | "backward" | "optimizer"
};

struct StepRecord {
  std::vector<StepCollective> collectives;
  train::StateBytes state;     // after the step: parameters, gradients, AdamW moments
  int64_t start_bytes = 0;     // live before the step (parameters; buffers)
  int64_t fb_peak_bytes = 0;   // highest live during forward and backward
  int64_t opt_peak_bytes = 0;  // highest live during the optimizer step
  // This rank's FLOPs in forward and backward (activation checkpointing's recompute included),
  // counted from the ops that ran (FlopCounter).
  double flops = 0;
  // The highest live of the step (of a steady-state step when a step ran before: AdamW then
  // holds its moments from the start).
  int64_t peak_bytes() const { return std::max(fb_peak_bytes, opt_peak_bytes); }
};

// Runs Trainer::forward_backward on `batch`, then the optimizer step (phase "optimizer"),
// counting collectives, `memory`'s bytes and forward and backward's FLOPs. The steps train_step
// adds between them (clipping by the global gradient norm, reducing the loss) are not run: they
// read values.
StepRecord record_step(train::Trainer& trainer, const train::Batch& batch,
                       CountingAllocator& memory);

// What train_step does beyond record_step, which a simulation cannot run (the collectives
// they issue, by the run's layout), one line each.
std::vector<std::string> not_simulated(const train::RunConfig& config);

}  // namespace dtensor::plan
