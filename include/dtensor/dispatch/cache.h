#pragma once
// Statistics of the sharding-decision cache (per thread).
#include <cstdint>

namespace dtensor::dispatch {
struct CacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t entries = 0;
  /// Results whose local tensor came back in another dim order than the DTensor's global
  /// strides and was copied into that order (a sign of a rule giving the wrong strides).
  int64_t layout_copies = 0;
};
CacheStats cache_stats();
void clear_cache();
}  // namespace dtensor::dispatch
