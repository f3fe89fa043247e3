#include "dtensor/checkpoint/sharded_layout.h"

#include <mutex>
#include <utility>

namespace dtensor::checkpoint {
namespace {
std::mutex& resolvers_mu() {
  static std::mutex mu;
  return mu;
}
std::vector<ShardedLayoutResolver>& resolvers() {
  static std::vector<ShardedLayoutResolver> r;
  return r;
}
}  // namespace

void register_sharded_layout(ShardedLayoutResolver resolver) {
  std::lock_guard<std::mutex> l(resolvers_mu());
  resolvers().push_back(std::move(resolver));
}

std::optional<ShardedLayout> sharded_layout_of(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  std::vector<ShardedLayoutResolver> copy;
  {
    std::lock_guard<std::mutex> l(resolvers_mu());
    copy = resolvers();
  }
  for (const auto& r : copy)
    if (auto layout = r(param)) return layout;
  return std::nullopt;
}

}  // namespace dtensor::checkpoint
