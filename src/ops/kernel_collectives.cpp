#include "dtensor/ops/kernel_collectives.h"

#include <c10/util/Exception.h>

#include <string>

#include "dtensor/comm/collectives.h"

namespace dtensor::ops {

at::Tensor kernel_all_reduce(std::string_view op, const at::Tensor& t, ReduceOp reduce,
                             const DeviceMesh& mesh, c10::ArrayRef<int64_t> mesh_dims) {
  at::Tensor out = t;
  for (int64_t m : mesh_dims) {
    try {
      // Over one rank every reduction is the identity (a TP=1 run issues none).
      if (mesh.size(m) == 1) continue;
      out = comm::all_reduce(out, reduce, mesh.group(m));
    } catch (c10::Error& e) {
      // Keeps the exception's type (a peer's failure stays one) and adds who asked.
      e.add_context("in the local kernel of " + std::string(op) + " (all_reduce over mesh dim " +
                    std::to_string(m) + " of " + mesh.str() + ")");
      throw;
    }
  }
  return out;
}

at::Tensor kernel_all_gather(std::string_view op, const at::Tensor& t, const DeviceMesh& mesh,
                             int64_t mesh_dim) {
  try {
    if (mesh.size(mesh_dim) == 1) return t.unsqueeze(0);
    return comm::all_gather_into_tensor(t.unsqueeze(0).contiguous(), 0, mesh.group(mesh_dim));
  } catch (c10::Error& e) {
    e.add_context("in the local kernel of " + std::string(op) + " (all_gather over mesh dim " +
                  std::to_string(mesh_dim) + " of " + mesh.str() + ")");
    throw;
  }
}

}  // namespace dtensor::ops
