#include "dtensor/core/shard_math.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace dtensor {

LocalShard compute_local_shape_and_global_offset(c10::IntArrayRef global_shape,
                                                 c10::IntArrayRef mesh_shape,
                                                 c10::IntArrayRef coordinate,
                                                 c10::ArrayRef<Placement> placements) {
  LocalShard out{global_shape.vec(), std::vector<int64_t>(global_shape.size(), 0)};
  for (size_t i = 0; i < placements.size(); ++i) {
    const Placement& p = placements[i];
    if (!p.is_shard()) continue;
    const int64_t d = p.dim();
    TORCH_CHECK(d >= 0 && d < static_cast<int64_t>(out.shape.size()), "dtensor: Shard(", d,
                ") out of range for a ", out.shape.size(), "-D tensor");
    const ShardRange rg = chunk_range(out.shape[d], mesh_shape[i], coordinate[i]);
    // An empty shard keeps the out-of-range offset convention (offset = global size).
    out.offset[d] = rg.size == 0 ? global_shape[d] : out.offset[d] + rg.offset;
    out.shape[d] = rg.size;
  }
  return out;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> compute_global_shape_and_stride(
    c10::IntArrayRef local_shape, c10::IntArrayRef local_stride, c10::IntArrayRef mesh_shape,
    c10::ArrayRef<Placement> placements) {
  std::vector<int64_t> shape = local_shape.vec(), stride = local_stride.vec();
  for (size_t i = 0; i < placements.size(); ++i) {
    if (!placements[i].is_shard()) continue;
    const int64_t d = placements[i].dim();
    const int64_t n = mesh_shape[i];
    const int64_t sd = stride[d];
    shape[d] *= n;
    for (size_t j = 0; j < stride.size(); ++j) {
      if (static_cast<int64_t>(j) != d && stride[j] >= sd) stride[j] *= n;
    }
  }
  return {shape, stride};
}

std::vector<int64_t> default_strides(c10::IntArrayRef shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) {
    s[i] = s[i + 1] * std::max<int64_t>(shape[i + 1], 1);
  }
  return s;
}

std::vector<int64_t> strides_like(c10::IntArrayRef shape, c10::IntArrayRef stride_order) {
  const size_t n = shape.size();
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return stride_order[a] < stride_order[b] || (stride_order[a] == stride_order[b] && a > b);
  });
  std::vector<int64_t> out(n, 1);
  int64_t acc = 1;
  for (size_t d : order) {
    out[d] = acc;
    acc *= std::max<int64_t>(shape[d], 1);
  }
  return out;
}

}  // namespace dtensor
