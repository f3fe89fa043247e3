#pragma once
// torch.chunk semantics for shards: chunk size c = ceil(N / k); rank r holds [r*c, min(N,
// (r+1)*c)); trailing ranks may hold fewer or zero elements (an empty shard reports offset N).
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "dtensor/core/placement.h"

namespace dtensor {

/// A 1-D shard: `size` elements starting at `offset`.
struct ShardRange {
  int64_t size;    ///< Number of elements (0 for an empty shard).
  int64_t offset;  ///< Index of the first element (N for an empty shard).
};

/// ceil(n / k): the size of a full torch.chunk chunk; 0 when k is 0.
inline int64_t full_chunk_size(int64_t n, int64_t k) { return k == 0 ? 0 : (n + k - 1) / k; }

/// Range of chunk `r` of `k` over `n` elements (torch.chunk rule).
inline ShardRange chunk_range(int64_t n, int64_t k, int64_t r) {
  const int64_t c = full_chunk_size(n, k);
  const int64_t off = r * c;
  if (off >= n) return {0, n};
  return {std::min(n, off + c) - off, off};
}

/// Local shape and global offset of the shard at `coordinate` (mesh dims applied left to
/// right, each on the size left by the previous level).
struct LocalShard {
  std::vector<int64_t> shape;   ///< Local sizes.
  std::vector<int64_t> offset;  ///< Global index of the shard's first element, per dim.
};
/// The LocalShard of `coordinate` (PyTorch's compute_local_shape_and_global_offset); throws for a
/// Shard dim out of range.
LocalShard compute_local_shape_and_global_offset(c10::IntArrayRef global_shape,
                                                 c10::IntArrayRef mesh_shape,
                                                 c10::IntArrayRef coordinate,
                                                 c10::ArrayRef<Placement> placements);

/// Global shape and stride from a local shard assuming even sharding (from_local's default):
/// each Shard(d) multiplies shape[d] by the mesh-dim size and every stride >= stride[d].
std::pair<std::vector<int64_t>, std::vector<int64_t>> compute_global_shape_and_stride(
    c10::IntArrayRef local_shape, c10::IntArrayRef local_stride, c10::IntArrayRef mesh_shape,
    c10::ArrayRef<Placement> placements);

/// Contiguous strides for `shape`.
std::vector<int64_t> default_strides(c10::IntArrayRef shape);

/// Dense strides for `shape` that keep the dim order of `stride_order` (innermost = smallest
/// stride first; ties keep the later dim inner, as contiguous strides do): the local layout of
/// a shard whose global tensor has strides `stride_order`.
std::vector<int64_t> strides_like(c10::IntArrayRef shape, c10::IntArrayRef stride_order);

}  // namespace dtensor
