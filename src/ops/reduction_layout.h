#pragma once
// Which shards of a reduced tensor dim may stay sharded through a reduction: reducing the local
// shards and combining the partial results is exact only if every shard is non-empty (for
// reductions without an identity: max, min, inf-norms) or all shards have the same size (for
// a mean). Decided from the global shape and placements only, so every rank agrees.
#include <algorithm>
#include <vector>

#include "dtensor/core/dtensor_spec.h"
#include "dtensor/core/shard_math.h"

namespace dtensor::ops {

struct ShardNeeds {
  bool even = false;      // all shards the same size (mean)
  bool nonempty = false;  // no empty shard (max, min, argmax, inf-norms)
};

// Per mesh dim: true where Shard(d) of the reduced tensor dim d may be kept. Mesh dims nest
// left to right, so the walk stops at the first level that breaks `needs`; that mesh dim and
// every later one sharding d are replicated first.
inline std::vector<bool> keepable_shards(const DTensorSpec& in, int64_t d, ShardNeeds needs) {
  const auto& pl = in.placements();
  std::vector<bool> keep(pl.size(), false);
  std::vector<int64_t> sizes{in.shape()[d]};  // distinct shard sizes so far
  for (size_t i = 0; i < pl.size(); ++i) {
    if (!pl[i].is_shard(d)) continue;
    const int64_t k = in.mesh().size(static_cast<int64_t>(i));
    std::vector<int64_t> next;
    for (int64_t s : sizes) {
      for (int64_t r = 0; r < k; ++r) next.push_back(chunk_range(s, k, r).size);
    }
    std::sort(next.begin(), next.end());
    next.erase(std::unique(next.begin(), next.end()), next.end());
    if ((needs.even && next.size() > 1) || (needs.nonempty && next.front() == 0)) break;
    keep[i] = true;
    sizes = std::move(next);
  }
  return keep;
}

}  // namespace dtensor::ops
