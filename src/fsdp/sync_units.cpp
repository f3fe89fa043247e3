// The registry of fully_shard's and replicate's units, and set_requires_gradient_sync.
#include "sync_units.h"

#include <unordered_map>
#include <vector>

#include "dtensor/fsdp/fully_shard.h"

namespace dtensor::fsdp {
namespace detail {
namespace {

// The weak reference to the module tells a live entry from one whose module is gone (its
// address may be reused).
struct UnitEntry {
  std::weak_ptr<const torch::nn::Module> module;
  bool owned = false;  // whether a shared_ptr owned the module (else only `sync` is checked)
  std::weak_ptr<GradientSync> sync;
  bool live(const torch::nn::Module* at) const {
    if (sync.expired()) return false;
    if (!owned) return true;
    const auto m = module.lock();
    return m && m.get() == at;
  }
};
std::mutex& units_mu() {
  static std::mutex mu;
  return mu;
}
std::unordered_multimap<const torch::nn::Module*, UnitEntry>& units() {
  static std::unordered_multimap<const torch::nn::Module*, UnitEntry> m;
  return m;
}

}  // namespace

void register_sync_unit(const torch::nn::Module& unit, const std::shared_ptr<GradientSync>& sync) {
  std::lock_guard<std::mutex> l(units_mu());
  for (auto it = units().begin(); it != units().end();)
    it = it->second.live(it->first) ? std::next(it) : units().erase(it);
  std::weak_ptr<const torch::nn::Module> self = unit.weak_from_this();
  units().emplace(&unit, UnitEntry{self, !self.expired(), sync});
}

}  // namespace detail

int64_t set_requires_gradient_sync(torch::nn::Module& module, bool requires_gradient_sync) {
  std::vector<std::shared_ptr<detail::GradientSync>> found;
  {
    std::lock_guard<std::mutex> l(detail::units_mu());
    auto visit = [&](const torch::nn::Module& m) {
      auto [begin, end] = detail::units().equal_range(&m);
      for (auto it = begin; it != end; ++it)
        if (it->second.live(&m))
          if (auto sync = it->second.sync.lock()) found.push_back(std::move(sync));
    };
    visit(module);
    for (const auto& m : module.modules(/*include_self=*/false)) visit(*m);
  }
  for (const auto& sync : found) {
    std::lock_guard<std::mutex> l(sync->mu);
    sync->requires_sync = requires_gradient_sync;
  }
  return static_cast<int64_t>(found.size());
}

}  // namespace dtensor::fsdp
