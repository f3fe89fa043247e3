#pragma once
// Counting the bytes LibTorch's CPU allocator hands out: memory measurements in tests.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace dtensor::testing {

// Counts the bytes the CPU allocator has handed out and not got back.
struct CountingAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> live{0}, peak{0};

  struct Ctx {
    c10::DataPtr inner;
    int64_t n;
    CountingAllocator* owner;
  };
  static void release(void* p) {
    auto* ctx = static_cast<Ctx*>(p);
    ctx->owner->live -= ctx->n;
    delete ctx;
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    const auto device = inner.device();
    const int64_t now = live += static_cast<int64_t>(n);
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
    return {data, new Ctx{std::move(inner), static_cast<int64_t>(n), this}, &release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// While alive, CPU tensors are allocated through one process-wide CountingAllocator (it
// outlives every tensor it allocated); live() and peak() are relative to the start.
class CountCpuBytes {
 public:
  CountCpuBytes() : counter_(instance()) {
    counter_.base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&counter_, /*priority=*/0);
    start_ = counter_.live;
    counter_.peak = start_;
  }
  ~CountCpuBytes() { c10::SetCPUAllocator(counter_.base, /*priority=*/0); }
  CountCpuBytes(const CountCpuBytes&) = delete;
  CountCpuBytes& operator=(const CountCpuBytes&) = delete;

  int64_t live() const { return counter_.live - start_; }  ///< Bytes held now, above the start.
  int64_t peak() const { return counter_.peak - start_; }  ///< Highest live() so far.

 private:
  static CountingAllocator& instance() {
    static CountingAllocator counter;
    return counter;
  }
  CountingAllocator& counter_;
  int64_t start_ = 0;
};

}  // namespace dtensor::testing
