#pragma once
// The toolkit for writing sharding rules, shared by the op rule families and by layers above
// (tp registers loss-parallel rules with it): local shapes, stride orders, placements remapped
// through a dim map, Decision builders, output metadata.
#include <ATen/InferSize.h>
#include <c10/util/Exception.h>

#include <functional>

#include "dtensor/dispatch/op_call.h"

namespace dtensor::ops {

/// Rule types, re-exported for rule writers.
using dispatch::Decision;
using dispatch::OpCall;
using dispatch::Strategy;

/// This rank's local shape of a global tensor laid out as `p` on `mesh`.
inline std::vector<int64_t> local_shape_of(const DeviceMesh& mesh, c10::IntArrayRef global,
                                           c10::ArrayRef<Placement> p) {
  const auto& c = mesh.coordinate();
  if (!c) return std::vector<int64_t>(global.size(), 0);
  return compute_local_shape_and_global_offset(global, mesh.shape(), *c, p).shape;
}

/// Placements with every Shard(d) moved to map(d) (nullopt -> Replicate).
template <typename F>
Placements remap_shards(c10::ArrayRef<Placement> p, F&& map) {
  Placements out;
  for (const auto& x : p) {
    if (x.is_shard()) {
      std::optional<int64_t> d = map(x.dim());
      out.push_back(d ? Shard(*d) : Replicate());
    } else {
      out.push_back(x);
    }
  }
  return out;
}

/// Placements of an input whose op can run on shards of some dims only: Shard(d) stays where
/// `keep(d)`; every other Shard and every Partial (the op is not linear) become Replicate.
template <typename F>
Placements keep_shards(c10::ArrayRef<Placement> p, F&& keep) {
  Placements out;
  for (const auto& x : p) out.push_back(x.is_shard() && keep(x.dim()) ? x : Replicate());
  return out;
}

/// Number of shards of tensor dim d.
inline int64_t shards_of_dim(const DeviceMesh& mesh, c10::ArrayRef<Placement> p, int64_t d) {
  int64_t n = 1;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i].is_shard(d)) n *= mesh.size(static_cast<int64_t>(i));
  }
  return n;
}

/// `d` wrapped into [0, ndim) (negative dims count from the end); a 0-d tensor counts as 1-d.
inline int64_t wrap_dim(int64_t d, int64_t ndim) {
  return c10::maybe_wrap_dim(d, std::max<int64_t>(ndim, 1));
}

/// A Decision with every output given `out` (tensor returns only).
inline Decision all_outputs(const OpCall& call, std::vector<Placements> inputs,
                            const Placements& out) {
  Decision d;
  d.inputs = std::move(inputs);
  for (const auto& r : call.schema().returns()) {
    const auto k = r.type()->kind();
    if (k == c10::TypeKind::TensorType || k == c10::TypeKind::ListType) {
      d.outputs.push_back(out);
    } else {
      d.outputs.push_back(std::nullopt);
    }
  }
  return d;
}

/// Index in call.inputs() of schema argument `arg`; -1 for an undefined optional tensor
/// (undefined optionals are not among the inputs, so positions must be looked up).
inline int input_of(const OpCall& call, int arg) {
  for (size_t i = 0; i < call.num_inputs(); ++i) {
    if (call.inputs()[i].arg == arg) return static_cast<int>(i);
  }
  return -1;
}

/// TensorMeta of a contiguous tensor of `shape` and `dtype`.
inline TensorMeta contiguous_meta(std::vector<int64_t> shape, at::ScalarType dtype) {
  auto stride = default_strides(shape);
  return TensorMeta{std::move(shape), std::move(stride), dtype};
}

/// One mesh dim's part of a strategy: a placement for each output, then one for each OpCall input.
using DimStrategy = std::vector<Placement>;
/// Predicate keeping (true) or dropping a candidate Strategy.
using StrategyFilter = std::function<bool(const Strategy&)>;

/// A rule's candidates on the whole mesh from what each mesh dim allows: every combination of
/// one DimStrategy per mesh dim (`choices[m]` for mesh dim m), mesh dim 0 varying slowest, the
/// order of PyTorch's itertools.product, so that equal-cost ties pick the same layout. Drops the
/// combinations `keep` rejects and, unless `drop_unshardable` is false, those that split an input
/// dim into more shards than it has elements (as PyTorch's is_tensor_shardable).
std::vector<Strategy> expand_to_mesh(const OpCall& call,
                                     const std::vector<std::vector<DimStrategy>>& choices,
                                     size_t num_outputs, const StrategyFilter& keep = nullptr,
                                     bool drop_unshardable = true);

/// The same choices on every mesh dim.
std::vector<Strategy> expand_to_mesh(const OpCall& call, const std::vector<DimStrategy>& choices,
                                     size_t num_outputs, const StrategyFilter& keep = nullptr);

/// Result dtype of return `ret`, found by running the op once on one-element CPU tensors of
/// the inputs' dtypes and ranks (for ops without meta kernels).
at::ScalarType proxy_result_dtype(const OpCall& call, size_t ret = 0);

}  // namespace dtensor::ops
