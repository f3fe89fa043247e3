#pragma once
// The layout of a DTensor: mesh, one placement per mesh dim, and the global shape/stride/dtype.
// Immutable; shared by pointer (SpecPtr) between DTensors and cache entries.
#include <c10/core/ScalarType.h>

#include <memory>
#include <string>
#include <vector>

#include "dtensor/core/placement.h"
#include "dtensor/core/shard_math.h"
#include "dtensor/mesh/device_mesh.h"

namespace dtensor {

/// Global shape, stride and dtype of a DTensor.
struct TensorMeta {
  std::vector<int64_t> shape;                      ///< Global sizes.
  std::vector<int64_t> stride;                     ///< Global strides, in elements.
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< Element type.
  /// Equal dtype, shape and stride.
  bool operator==(const TensorMeta& o) const {
    return dtype == o.dtype && shape == o.shape && stride == o.stride;
  }
};

/// A DTensor's layout: mesh, one placement per mesh dim and the global TensorMeta (immutable).
class DTensorSpec {
 public:
  /// Checks one placement per mesh dim and shard dims in range; normalises negative dims.
  DTensorSpec(DeviceMesh mesh, c10::ArrayRef<Placement> placements, TensorMeta meta);

  const DeviceMesh& mesh() const { return mesh_; }              ///< The device mesh.
  const Placements& placements() const { return placements_; }  ///< One placement per mesh dim.
  const TensorMeta& meta() const { return meta_; }              ///< Global shape, stride and dtype.
  const std::vector<int64_t>& shape() const { return meta_.shape; }    ///< Global sizes.
  const std::vector<int64_t>& stride() const { return meta_.stride; }  ///< Global strides.
  c10::ScalarType dtype() const { return meta_.dtype; }                ///< Element type.
  /// Number of tensor dims.
  int64_t ndim() const { return static_cast<int64_t>(meta_.shape.size()); }

  bool is_replicated() const;  // every mesh dim Replicate
  bool has_partial() const;    ///< Some mesh dim is Partial.
  bool has_shard() const;      ///< Some mesh dim is Shard.
  int64_t num_shards() const;  // product of mesh sizes over Shard mesh dims
  /// dim_map[t] = mesh dim sharding tensor dim t, or -1 (error if two mesh dims shard it).
  std::vector<int64_t> dim_map() const;

  /// This rank's local shard (empty shape when the rank is not in the mesh).
  LocalShard local_shard() const;
  /// Shape of this rank's shard.
  std::vector<int64_t> local_shape() const { return local_shard().shape; }

  /// Same mesh and meta, other placements.
  std::shared_ptr<const DTensorSpec> with_placements(c10::ArrayRef<Placement> p) const;

  size_t hash() const { return hash_; }  ///< Precomputed hash of mesh, placements and meta.
  /// Same mesh, placements and meta.
  bool operator==(const DTensorSpec& o) const;
  bool operator!=(const DTensorSpec& o) const { return !(*this == o); }  ///< Negation of ==.
  std::string str() const;  // Spec(S(0), R; shape=[8, 4]; dtype=Float)

 private:
  DeviceMesh mesh_;
  Placements placements_;
  TensorMeta meta_;
  size_t hash_;
};

/// Shared, immutable spec, as DTensors and caches hold it.
using SpecPtr = std::shared_ptr<const DTensorSpec>;

/// Builds a spec (see DTensorSpec's constructor for the checks).
inline SpecPtr make_spec(DeviceMesh mesh, c10::ArrayRef<Placement> placements, TensorMeta meta) {
  return std::make_shared<const DTensorSpec>(std::move(mesh), placements, std::move(meta));
}

/// Normalises negative Shard dims and checks one placement per mesh dim, with the message
/// PyTorch gives.
Placements normalize_placements(c10::ArrayRef<Placement> placements, int64_t tensor_ndim,
                                const DeviceMesh& mesh, const char* api);

}  // namespace dtensor
