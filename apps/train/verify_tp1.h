#pragma once
// --verify-tp1: the same steps again on one device with plain LibTorch (no DTensors, no
// communication) from the same seed, checkpoint and batches, and the loss curves compared.
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "common/corpus.h"
#include "common/run_config.h"
#include "common/trainer.h"

namespace dtensor::train {

struct LossComparison {
  int64_t step = 0;  // 1-based
  double loss_tp = 0;
  double loss_ref = 0;
  double rel_diff = 0;  // |tp - ref| / |ref|
};

struct VerifyReport {
  std::vector<LossComparison> rows;
  double max_rel_diff = 0;
  int64_t worst_step = 0;
  double rtol = 0;
  bool passed = false;
};

// The single-device trainer: plain LibTorch from the same seed, and from the checkpoint the
// TP run resumed from when `resume_from` is not empty (made before training, so that the
// checkpoint is read before any rotation deletes it).
Trainer make_reference_trainer(const RunConfig& config, const std::string& resume_from);

// Runs `reference` through the steps first_step .. first_step + tp_losses.size() - 1 and
// compares its losses with `tp_losses`. `on_step(done, total, loss)` reports progress.
VerifyReport verify_against_one_device(
    Trainer& reference, const BatchSampler& train, const std::vector<double>& tp_losses,
    int64_t first_step, double rtol, const std::function<void(int64_t, int64_t, double)>& on_step);

// "step  loss TP=2  loss TP=1  rel diff" with up to `max_rows` rows (the first ones, evenly
// spaced ones, the worst and the last), then the verdict line; `run` names the distributed run
// ("TP=2", "FSDP=2").
void print_verify_report(std::ostream& out, const VerifyReport& report, const std::string& run,
                         size_t max_rows = 12);

}  // namespace dtensor::train
