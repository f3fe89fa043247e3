#pragma once
// One training step of a dtensor_train Trainer, recorded: its collectives (as CommDebugMode
// counts them, with the phase of each), its memory by an allocator's accounting, and the state
// it leaves. dtensor_plan runs it on meta tensors in a simulated world (simulate.h); the tests
// run the same function on real tensors over Gloo and compare.
#include <c10/core/Allocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "dtensor/comm/comm_debug_mode.h"
#include "train/corpus.h"
#include "train/trainer.h"

namespace dtensor::plan {

// Counts the bytes an allocator of c10's registry (the CPU's, or the meta device's: meta
// storages are allocated through it at their true size, with no memory behind them) hands out
// and has not got back.
class CountingAllocator final : public c10::Allocator {
 public:
  // The counter of `device`, installed as its allocator on first use and for good (storages it
  // counted may outlive any scope: caches keep tensors).
  static CountingAllocator& of(c10::DeviceType device);

  // From now on live() and peak() count from the bytes live now.
  void set_origin() {
    origin_ = live_.load();
    peak_ = origin_.load();
  }
  int64_t live() const { return live_ - origin_; }
  int64_t peak() const { return peak_ - origin_; }
  void reset_peak() { peak_ = live_.load(); }

  c10::DataPtr allocate(size_t n) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  // Memory with an address (the CPU's) is handed out with the address as its context, as
  // LibTorch's own allocators do: kernels that take raw blocks (raw_allocate, e.g. bfloat16
  // matmuls) need that.
  c10::DeleterFnPtr raw_deleter() const override { return &release_block; }

 private:
  explicit CountingAllocator(c10::DeviceType device);
  struct Ctx;
  static void release(void* ctx);
  static void release_block(void* data);
  c10::Allocator* base_;
  std::atomic<int64_t> live_{0}, peak_{0}, origin_{0};
};

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
  // The highest live of the step (of a steady-state step when a step ran before: AdamW then
  // holds its moments from the start).
  int64_t peak_bytes() const { return std::max(fb_peak_bytes, opt_peak_bytes); }
};

// Runs Trainer::forward_backward on `batch`, then the optimizer step (phase "optimizer"),
// counting collectives and `memory`'s bytes. The steps train_step adds between them (clipping
// by the global gradient norm, reducing the loss) are not run: they read values.
StepRecord record_step(train::Trainer& trainer, const train::Batch& batch,
                       CountingAllocator& memory);

// What train_step does beyond record_step, which a simulation cannot run (the collectives
// they issue, by the run's layout), one line each.
std::vector<std::string> not_simulated(const train::RunConfig& config);

}  // namespace dtensor::plan
