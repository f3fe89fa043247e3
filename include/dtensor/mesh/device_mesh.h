#pragma once
// An N-D layout of ranks with named dimensions and one process group per dimension.
// DeviceMesh is a cheap-to-copy handle (like c10::Device); copies and slices share groups.
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/comm/process_group.h"

namespace dtensor {

/// An N-D grid of ranks with optional dim names and one process group per dim (PyTorch's
/// DeviceMesh). A cheap-to-copy handle: copies share the groups.
class DeviceMesh {
 public:
  /// `ranks` lists the global ranks row-major over `shape`. Creates one process group per mesh
  /// dimension (every rank must construct the same meshes in the same order).
  DeviceMesh(c10::DeviceType device_type, std::vector<int64_t> shape, std::vector<int64_t> ranks,
             std::vector<std::string> dim_names = {});

  /// Device type of the local shards (kCPU or kCUDA).
  c10::DeviceType device_type() const;
  /// Device type as a string: "cpu" or "cuda".
  std::string device_type_str() const;
  /// The device local shards live on: cpu, or cuda:<local rank mod device count>.
  c10::Device device() const;
  /// Size of each mesh dim.
  const std::vector<int64_t>& shape() const;
  /// Number of mesh dims.
  int64_t ndim() const;
  /// Size of mesh dim `mesh_dim` (throws when out of range).
  int64_t size(int64_t mesh_dim) const;
  int64_t size() const;  // number of ranks in the mesh
  /// Name of each mesh dim; empty when the mesh has none.
  const std::vector<std::string>& dim_names() const;
  /// Whether the dims are named.
  bool has_dim_names() const;
  int64_t dim_index(const std::string& name) const;  // error listing the valid names
  const std::vector<int64_t>& ranks() const;         // global ranks, row-major

  /// This rank's index along every mesh dim; nullopt when this rank is not in the mesh.
  const std::optional<std::vector<int64_t>>& coordinate() const;
  /// Whether this rank is in the mesh.
  bool contains_this_rank() const { return coordinate().has_value(); }
  /// Rank within the group of `mesh_dim` (= coordinate[mesh_dim]). A 1-D mesh allows no argument.
  int64_t get_local_rank(std::optional<int64_t> mesh_dim = std::nullopt) const;
  /// Rank within the group of the mesh dim named `name`.
  int64_t get_local_rank(const std::string& name) const;

  /// The process group of `mesh_dim`; throws when out of range or this rank is not in the mesh.
  comm::ProcessGroup& group(int64_t mesh_dim) const;
  /// Like group(), as a shared pointer (PyTorch's `get_group`).
  std::shared_ptr<comm::ProcessGroup> get_group(int64_t mesh_dim) const;
  /// The process group of the mesh dim named `name`.
  std::shared_ptr<comm::ProcessGroup> get_group(const std::string& name) const;

  /// mesh["tp"] and mesh.slice({"dp", "tp"}): sub-meshes that re-use this mesh's groups.
  DeviceMesh operator[](const std::string& name) const;
  /// Sub-mesh of the named dims, in the given order.
  DeviceMesh slice(const std::vector<std::string>& names) const;
  /// The mesh whose dims are those of `meshes`, in the order given (PyTorch's
  /// DeviceMesh._concatenate): each must be `root` or a slice of one mesh `root`, and no dim
  /// may repeat. Unlike slice(), any order: concatenate({mesh["tp"], mesh["dp"]}) lays a
  /// tensor out over tp first, then dp, on the groups of `mesh` (no new process groups).
  static DeviceMesh concatenate(const std::vector<DeviceMesh>& meshes);

  /// Meshes are equal when they have the same device type, shape, ranks and names and belong to
  /// the same world (a mesh made before destroy_process_group() equals none made after it).
  bool operator==(const DeviceMesh& o) const;
  bool operator!=(const DeviceMesh& o) const { return !(*this == o); }  ///< Negation of ==.
  /// Unique per distinct mesh object (copies share it); used in cache keys.
  uint64_t id() const;
  size_t hash() const;      ///< Hash consistent with ==.
  std::string str() const;  // DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))

  /// Implementation detail (defined in device_mesh.cpp).
  struct Impl;

 private:
  explicit DeviceMesh(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

/// init_device_mesh("cpu", {2, 2}, {"dp", "tp"}): ranks 0..n-1 row-major. Joins the process
/// group from the environment first if that has not happened yet.
DeviceMesh init_device_mesh(const std::string& device_type, std::vector<int64_t> mesh_shape,
                            std::vector<std::string> mesh_dim_names = {});

/// The 1-D mesh playing `role` ("tp", "pp", "dp", ...) in `mesh`: its dimension named `role`
/// (the mesh itself when that is its only dimension); a 1-D mesh without names plays any one role,
/// the one its caller passed it for; otherwise nullopt. The one rule of every role lookup
/// (models::ParallelDims, pp::get_pp_mesh).
std::optional<DeviceMesh> mesh_for_role(const DeviceMesh& mesh, const std::string& role);

/// The mesh DTensor APIs use when none is passed (set with MeshGuard, like `with mesh:`).
std::optional<DeviceMesh> current_mesh();
/// Makes `mesh` the current_mesh() on this thread until destruction; guards nest.
class MeshGuard {
 public:
  /// Pushes `mesh` on this thread's mesh stack.
  explicit MeshGuard(const DeviceMesh& mesh);
  /// Pops it.
  ~MeshGuard();
  MeshGuard(const MeshGuard&) = delete;
  MeshGuard& operator=(const MeshGuard&) = delete;
};

/// Prints m.str().
std::ostream& operator<<(std::ostream& os, const DeviceMesh& m);

}  // namespace dtensor
