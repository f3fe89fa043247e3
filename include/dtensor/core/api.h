#pragma once
// The DTensor API with PyTorch's semantics and autograd behaviour
// (docs/ARCHITECTURE.md, "DTensor API semantics").
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "dtensor/core/dtensor_impl.h"

namespace dtensor {

/// Options of from_local (PyTorch's `DTensor.from_local` keyword arguments).
struct FromLocalOptions {
  /// Check dtype/requires_grad/shape/stride agree on every rank and broadcast replicas from the
  /// first rank of each Replicate mesh dim (communicates).
  bool run_check = false;
  /// Global shape and stride; give both for uneven shards (the default assumes even ones).
  std::optional<std::vector<int64_t>> shape;
  std::optional<std::vector<int64_t>> stride;  ///< Global stride (see shape).
};

/// Wraps this rank's `local` shard. Differentiable: the gradient of `local` is the DTensor
/// gradient moved back to `placements` (a Partial gradient is all-reduced, a shard gathered).
at::Tensor from_local(const at::Tensor& local, const DeviceMesh& mesh,
                      c10::ArrayRef<Placement> placements, const FromLocalOptions& options = {});
/// With the current mesh (MeshGuard) and all-Replicate placements by default.
at::Tensor from_local(const at::Tensor& local,
                      std::optional<std::vector<Placement>> placements = {},
                      const FromLocalOptions& options = {});

/// The local shard as a plain tensor. Differentiable: the gradient is wrapped with
/// `grad_placements` (default: this DTensor's placements). Without grad mode it is the
/// DTensor's own local tensor object.
at::Tensor to_local(const at::Tensor& dtensor,
                    std::optional<std::vector<Placement>> grad_placements = {});

/// Options of redistribute (PyTorch's `DTensor.redistribute` keyword arguments).
struct RedistributeOptions {
  bool async_op = false;                          // leave the collective in flight
  std::optional<c10::ScalarType> forward_dtype;   // cast before communicating
  std::optional<c10::ScalarType> backward_dtype;  // cast the gradient before its collective
};

/// New DTensor with `placements` (never Partial). Differentiable.
at::Tensor redistribute(const at::Tensor& dtensor, const DeviceMesh& mesh,
                        c10::ArrayRef<Placement> placements,
                        const RedistributeOptions& options = {});
/// On the DTensor's own mesh.
at::Tensor redistribute(const at::Tensor& dtensor, c10::ArrayRef<Placement> placements,
                        const RedistributeOptions& options = {});

/// The whole tensor on every rank (plain). Differentiable.
at::Tensor full_tensor(const at::Tensor& dtensor,
                       std::optional<std::vector<Placement>> grad_placements = {});

/// Splits a leaf tensor over the mesh: Shard dims are scattered and Replicate dims broadcast
/// from group rank `src_data_rank`; with nullopt every rank keeps its own data (no comm).
at::Tensor distribute_tensor(const at::Tensor& tensor, const DeviceMesh& mesh,
                             c10::ArrayRef<Placement> placements,
                             std::optional<int64_t> src_data_rank = 0);
/// With the current mesh (MeshGuard) and all-Replicate placements by default.
at::Tensor distribute_tensor(const at::Tensor& tensor,
                             std::optional<std::vector<Placement>> placements = {},
                             std::optional<int64_t> src_data_rank = 0);

}  // namespace dtensor
