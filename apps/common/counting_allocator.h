#pragma once
// Counting an allocator's bytes: dtensor_plan's memory per rank on meta tensors, and
// dtensor_train's measured peak of a step on CPU tensors.
#include <c10/core/Allocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace dtensor::train {

// Counts the bytes an allocator of c10's registry (the CPU's, or the meta device's: meta
// storages are allocated through it at their true size, with no memory behind them) hands out
// and has not got back.
class CountingAllocator final : public c10::Allocator {
 public:
  // The counter of `device`, installed as its allocator on first use; never freed (storages it
  // counted may outlive any scope: caches keep tensors).
  static CountingAllocator& of(c10::DeviceType device);
  // Hands `device`'s allocations back to the allocator it counts for (blocks it counted are
  // still released through it), and to itself again.
  void restore();
  void install();

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
  c10::DeviceType device_;
  c10::Allocator* base_;
  std::atomic<int64_t> live_{0}, peak_{0}, origin_{0};
};

}  // namespace dtensor::train
