#include "step_record.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "dtensor/comm/recording_backend.h"

namespace dtensor::plan {

struct CountingAllocator::Ctx {
  c10::DataPtr inner;
  int64_t n;
  CountingAllocator* owner;
};

CountingAllocator::CountingAllocator(c10::DeviceType device) : base_(c10::GetAllocator(device)) {
  // Priority 1 outranks the allocators LibTorch registers (0).
  c10::SetAllocator(device, this, /*priority=*/1);
}

CountingAllocator& CountingAllocator::of(c10::DeviceType device) {
  static CountingAllocator* cpu = nullptr;
  static CountingAllocator* meta = nullptr;
  CountingAllocator*& slot = device == c10::DeviceType::CPU ? cpu : meta;
  TORCH_CHECK(device == c10::DeviceType::CPU || device == c10::DeviceType::Meta,
              "dtensor_plan counts CPU or meta allocations, not ", device);
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
    TORCH_INTERNAL_ASSERT(it != blocks().live.end(), "dtensor_plan: releasing an unknown block");
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

StepRecord record_step(train::Trainer& trainer, const train::Batch& batch,
                       CountingAllocator& memory) {
  StepRecord out;
  CommDebugMode comm;
  out.start_bytes = memory.live();
  memory.reset_peak();
  { at::Tensor loss = trainer.forward_backward(batch); }
  out.fb_peak_bytes = memory.peak();
  const size_t backward_end = comm.records().size();
  memory.reset_peak();
  {
    comm::RecordingPhase phase("optimizer");
    trainer.optimizer().step();
  }
  out.opt_peak_bytes = memory.peak();
  comm.exit();
  const auto records = comm.records();
  for (size_t i = 0; i < records.size(); ++i) {
    const char* phase = i >= backward_end     ? "optimizer"
                        : records[i].backward ? "backward"
                                              : "forward";
    out.collectives.push_back({records[i], phase});
  }
  out.state = trainer.state_bytes();
  return out;
}

std::vector<std::string> not_simulated(const train::RunConfig& c) {
  std::vector<std::string> out;
  const std::string clip = "gradient-norm clipping (fsdp::clip_grad_norm_) reads the global norm";
  if (c.pp > 1) {
    out.push_back(clip +
                  (c.tp > 1 ? ": the DTensor-aware norm's all_reduce(s) over tp, then " : ": ") +
                  "1 all_reduce of 1 float64 over pp");
    out.push_back(
        "loss and bubble to every rank (PipelinePart::step_values): 1 all_reduce of 2 float64 "
        "over pp");
  } else if (c.fsdp) {
    out.push_back(clip + ": 1 all_reduce of 2 float64 over dp" +
                  (c.tp > 1 ? std::string(", 1 of 1 float64 over tp") : std::string()));
    out.push_back("loss averaged over dp (Trainer::mean_over_dp): 1 all_reduce of 1 float64");
  } else {
    if (c.world_size > 1)
      out.push_back(clip +
                    ": clip_grad_norm_ on DTensor gradients (all_reduce of the sharded "
                    "gradients' norms over tp)");
    if (c.dp > 1)
      out.push_back("loss averaged over dp (Trainer::mean_over_dp): 1 all_reduce of 1 float64");
  }
  out.push_back(
      "the first step's one-time messages: the pipeline's activation shapes, the TP "
      "plan's cross-rank check (one all_gather at parallelize time)");
  out.push_back("NaN/inf checks and anything else that reads a tensor's value (.item())");
  return out;
}

}  // namespace dtensor::plan
