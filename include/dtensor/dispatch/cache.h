#pragma once
// Statistics of the sharding-decision cache (per thread).
#include <cstdint>

namespace dtensor::dispatch {
/// Counters of this thread's decision cache.
struct CacheStats {
  int64_t hits = 0;     ///< Lookups that found a cached decision.
  int64_t misses = 0;   ///< Lookups that ran the sharding rule.
  int64_t entries = 0;  ///< Decisions currently cached.
  /// Results whose local tensor came back in another dim order than the DTensor's global
  /// strides and was copied into that order (a sign of a rule giving the wrong strides).
  int64_t layout_copies = 0;
};
/// This thread's counters, with `entries` read now.
CacheStats cache_stats();
/// Empties this thread's decision cache (the hit/miss counters are kept).
void clear_cache();
}  // namespace dtensor::dispatch
