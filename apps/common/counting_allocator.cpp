#include "counting_allocator.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>

namespace dtensor::train {

struct CountingAllocator::Ctx {
  c10::DataPtr inner;
  int64_t n;
  CountingAllocator* owner;
};

CountingAllocator::CountingAllocator(c10::DeviceType device)
    : device_(device), base_(c10::GetAllocator(device)) {
  install();
}

// Priority 1 outranks the allocators LibTorch registers (0).
void CountingAllocator::install() { c10::SetAllocator(device_, this, /*priority=*/1); }
void CountingAllocator::restore() { c10::SetAllocator(device_, base_, /*priority=*/1); }

CountingAllocator& CountingAllocator::of(c10::DeviceType device) {
  static CountingAllocator* cpu = nullptr;
  static CountingAllocator* meta = nullptr;
  CountingAllocator*& slot = device == c10::DeviceType::CPU ? cpu : meta;
  TORCH_CHECK(device == c10::DeviceType::CPU || device == c10::DeviceType::Meta,
              "CountingAllocator counts CPU or meta allocations, not ", device);
  if (slot == nullptr) slot = new CountingAllocator(device);  // never freed: see the header
  return *slot;
}

namespace {

// The blocks with an address handed out and not yet released, by address.
struct Blocks {
  std::mutex mu;
  std::unordered_map<void*, void*> live;  // address -> its CountingAllocator::Ctx
};
Blocks& blocks() {
  static auto* b = new Blocks;  // never freed: storages may be released at exit
  return *b;
}

}  // namespace

void CountingAllocator::release(void* p) {
  auto* ctx = static_cast<Ctx*>(p);
  ctx->owner->live_ -= ctx->n;
  delete ctx;
}

void CountingAllocator::release_block(void* data) {
  void* ctx = nullptr;
  {
    std::lock_guard<std::mutex> l(blocks().mu);
    auto it = blocks().live.find(data);
    TORCH_INTERNAL_ASSERT(it != blocks().live.end(),
                          "CountingAllocator: releasing an unknown block");
    ctx = it->second;
    blocks().live.erase(it);
  }
  release(ctx);
}

c10::DataPtr CountingAllocator::allocate(size_t n) {
  c10::DataPtr inner = base_->allocate(n);
  void* data = inner.get();
  const c10::Device device = inner.device();
  if (data == nullptr && n == 0) return inner;
  const int64_t now = live_ += static_cast<int64_t>(n);
  int64_t p = peak_.load();
  while (now > p && !peak_.compare_exchange_weak(p, now)) {
  }
  auto* ctx = new Ctx{std::move(inner), static_cast<int64_t>(n), this};
  if (data == nullptr) return {data, ctx, &release, device};  // the meta device: no addresses
  {
    std::lock_guard<std::mutex> l(blocks().mu);
    blocks().live.emplace(data, ctx);
  }
  return {data, data, &release_block, device};
}

void CountingAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  base_->copy_data(dest, src, count);
}

}  // namespace dtensor::train
