#pragma once
// Planner and executor for changing a DTensor's placements (docs/ARCHITECTURE.md,
// "Redistribution"): per-mesh-dim transitions with torch.chunk padding, and the greedy N-D planner.
#include <ATen/core/Tensor.h>

#include <vector>

#include "dtensor/comm/collectives.h"
#include "dtensor/core/dtensor_spec.h"

namespace dtensor {

/// One transition of a redistribution plan: mesh dim `mesh_dim` goes from `src` to `dst`.
struct RedistributeStep {
  int64_t mesh_dim;  ///< The mesh dim that changes.
  Placement src;     ///< Its placement before.
  Placement dst;     ///< Its placement after.
  /// Same mesh dim, src and dst.
  bool operator==(const RedistributeStep& o) const {
    return mesh_dim == o.mesh_dim && src == o.src && dst == o.dst;
  }
};

/// The ordered per-mesh-dim transitions from `src` to `dst` placements (cached).
std::vector<RedistributeStep> plan_redistribute(c10::ArrayRef<Placement> src,
                                                c10::ArrayRef<Placement> dst);

/// Options of redistribute_local.
struct RedistributeLocalOptions {
  bool is_backward = false;  // R->P keeps the replica (no division); S->P gathers
  bool async_op = false;     // leave the last collective in flight
};

/// Moves `local` (laid out as `src`) to `dst`'s placements. Both specs share mesh and meta.
/// Ranks outside the mesh get their input back untouched.
comm::PendingResult redistribute_local(const at::Tensor& local, const DTensorSpec& src,
                                       const DTensorSpec& dst,
                                       const RedistributeLocalOptions& options = {});

/// `local`, or a copy of it, laid out in the dim order of `global_stride` (the layout every
/// DTensor's local tensor has; see strides_like), broadcast (stride 0) along the dims the global
/// strides broadcast.
at::Tensor follow_stride_order(at::Tensor local, c10::IntArrayRef global_stride);

/// Placements a gradient is reduced to in backward: each Partial becomes Replicate.
Placements backward_target(c10::ArrayRef<Placement> p);

/// Local chunk `r` of `k` along `dim` (torch.chunk rule), cloned so it owns its memory.
at::Tensor local_chunk(const at::Tensor& t, int64_t dim, int64_t k, int64_t r);

}  // namespace dtensor
