#pragma once
// A CPU allocator that counts the bytes it has handed out and not got back, and their peak: what
// a piece of code allocates through LibTorch, measured from outside it.
//
//   CountingAllocator::Scope count;        // installs the counter until it goes out of scope
//   ...;                                   // code under test
//   count.peak();                          // highest live bytes above the start
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>

namespace dtensor::testing {

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

  // The process-wide counter (it must outlive every tensor it allocated), installed as the CPU
  // allocator for the scope's lifetime; peak() and live() are relative to the scope's start.
  class Scope {
   public:
    Scope() : counter_(instance()) {
      counter_.base = c10::GetCPUAllocator();
      c10::SetCPUAllocator(&counter_, /*priority=*/0);
      start_ = counter_.live;
      counter_.peak = start_;
    }
    ~Scope() { c10::SetCPUAllocator(counter_.base, /*priority=*/0); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    int64_t live() const { return counter_.live - start_; }
    int64_t peak() const { return counter_.peak - start_; }

   private:
    static CountingAllocator& instance() {
      static CountingAllocator counter;
      return counter;
    }
    CountingAllocator& counter_;
    int64_t start_ = 0;
  };
};

}  // namespace dtensor::testing
