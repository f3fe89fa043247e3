#pragma once
// Collectives issued from inside an op's local kernel, after its local computation: the one
// answer of equal() over shards, a loss's total weight over a sharded batch, the vocab-parallel
// softmax's max and sum. Rules never communicate; kernels do it only through these, so every
// such collective is an ordinary comm collective (counted by CommDebugMode, failing with the
// rank, group and collective) whose errors also name the op and mesh dim that issued it.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string_view>

#include "dtensor/comm/reduce_op.h"
#include "dtensor/mesh/device_mesh.h"

namespace dtensor::ops {

/// all_reduce of `t` for the kernel of `op` ("aten::equal") over the ranks of each of
/// `mesh_dims` in turn, skipping mesh dims of one rank; `t` itself when none is left.
at::Tensor kernel_all_reduce(std::string_view op, const at::Tensor& t, ReduceOp reduce,
                             const DeviceMesh& mesh, c10::ArrayRef<int64_t> mesh_dims);

/// all_gather of `t` for the kernel of `op` over the ranks of mesh dim `mesh_dim`: a tensor
/// (ranks, *t.sizes()) holding rank i's `t` at index i (`t.unsqueeze(0)` over one rank).
at::Tensor kernel_all_gather(std::string_view op, const at::Tensor& t, const DeviceMesh& mesh,
                             int64_t mesh_dim);

}  // namespace dtensor::ops
