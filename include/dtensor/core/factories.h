#pragma once
// Creating DTensors directly in their layout: each rank allocates only its shard.
#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include "dtensor/core/dtensor_impl.h"
#include "dtensor/core/random.h"

namespace dtensor {

/// Uninitialised DTensor of global `size`; each rank allocates its shard (PyTorch's
/// `torch.distributed.tensor.empty`).
at::Tensor empty(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                 at::TensorOptions options = {});
/// Like empty(), filled with 0 (PyTorch's `torch.distributed.tensor.zeros`).
at::Tensor zeros(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                 at::TensorOptions options = {});
/// Like empty(), filled with 1 (PyTorch's `torch.distributed.tensor.ones`).
at::Tensor ones(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                at::TensorOptions options = {});
/// Like empty(), filled with `value` (PyTorch's `torch.distributed.tensor.full`).
at::Tensor full(at::IntArrayRef size, const at::Scalar& value, const DeviceMesh& mesh,
                c10::ArrayRef<Placement> placements, at::TensorOptions options = {});

/// Random DTensors. Every element's value depends only on (seed, draw offset, global index):
/// replicas draw equal numbers, shards disjoint ones, and the whole tensor equals what one
/// device gets from the same seed, whatever the mesh or placements.
at::Tensor rand(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                at::TensorOptions options = {});
/// Standard normal values, with the same guarantees as rand() (which gives uniform [0, 1)).
at::Tensor randn(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                 at::TensorOptions options = {});

/// The same streams on one device (for single-device references and for initialising plain
/// tensors identically): values of elements [0, numel) of a draw at the current offset.
/// Uniform [0, 1) values.
at::Tensor rand_global(at::IntArrayRef size, at::TensorOptions options = {});
/// Standard normal values.
at::Tensor randn_global(at::IntArrayRef size, at::TensorOptions options = {});

}  // namespace dtensor
