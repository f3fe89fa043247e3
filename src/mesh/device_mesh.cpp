#include "dtensor/mesh/device_mesh.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <sstream>

namespace dtensor {

struct DeviceMesh::Impl {
  uint64_t id;
  c10::DeviceType device_type;
  c10::Device device{c10::DeviceType::CPU};
  std::vector<int64_t> shape;
  std::vector<int64_t> ranks;
  std::vector<std::string> names;
  std::optional<std::vector<int64_t>> coordinate;
  std::vector<std::shared_ptr<comm::ProcessGroup>> groups;  // null where this rank is absent
  // The world the mesh was made in: a mesh of a destroyed world (its groups are gone) never
  // equals one of the next, which a cached sharding decision would otherwise hand its groups.
  std::shared_ptr<comm::ProcessGroup> world;
  size_t hash;
  // The mesh this one was sliced from (null for a mesh made by the constructor) and the dims of
  // it this mesh's dims are: what concatenate() joins sub-meshes through.
  std::shared_ptr<const Impl> root;
  std::vector<int64_t> root_dims;
  // concatenate()'s meshes of this root by their dims, held weakly: one mesh object (one id in
  // the sharding-decision caches) for every parameter laid out on the same dims.
  mutable std::mutex concatenated_mu;
  mutable std::map<std::vector<int64_t>, std::weak_ptr<const Impl>> concatenated;
};

namespace {

uint64_t next_mesh_id() {
  static std::atomic<uint64_t> n{1};
  return n++;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + ("'" + v[i] + "'");
  return s;
}

c10::Device local_device(c10::DeviceType type) {
  if (type != c10::DeviceType::CUDA) return c10::Device(type);
  const int n = at::detail::getCUDAHooks().deviceCount();
  TORCH_CHECK(n > 0, "dtensor: a 'cuda' mesh needs a CUDA device, but none is visible");
  const int idx = comm::get_local_rank() % n;
  c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(c10::Device(type, idx));
  return c10::Device(type, static_cast<c10::DeviceIndex>(idx));
}

size_t hash_impl(const DeviceMesh::Impl& m) {
  size_t h = static_cast<size_t>(m.device_type);
  for (auto r : m.ranks) h = h * 1000003u ^ static_cast<size_t>(r);
  for (auto s : m.shape) h = h * 31u ^ static_cast<size_t>(s);
  for (const auto& n : m.names) h ^= std::hash<std::string>{}(n);
  return h;
}

std::vector<DeviceMesh>& mesh_stack() {
  thread_local std::vector<DeviceMesh> s;
  return s;
}

}  // namespace

DeviceMesh::DeviceMesh(c10::DeviceType device_type, std::vector<int64_t> shape,
                       std::vector<int64_t> ranks, std::vector<std::string> dim_names) {
  TORCH_CHECK(!shape.empty(), "dtensor: a DeviceMesh needs at least one dimension");
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  TORCH_CHECK(static_cast<int64_t>(ranks.size()) == n, "dtensor: mesh shape ",
              c10::IntArrayRef(shape), " holds ", n, " ranks but ", ranks.size(), " were given");
  const int world = comm::get_world_size();
  std::set<int64_t> seen;
  for (auto r : ranks) {
    TORCH_CHECK(r >= 0 && r < world, "dtensor: mesh rank ", r, " is outside the world of ", world,
                " ranks");
    TORCH_CHECK(seen.insert(r).second, "dtensor: mesh rank ", r, " appears twice");
  }
  if (!dim_names.empty()) {
    TORCH_CHECK(dim_names.size() == shape.size(),
                "mesh_shape and mesh_dim_names should have same length! (got ", shape.size(),
                " dims and ", dim_names.size(), " names)");
    TORCH_CHECK(
        std::set<std::string>(dim_names.begin(), dim_names.end()).size() == dim_names.size(),
        "Each mesh_dim_name must be unique. Found repeated names in (", join(dim_names), ")");
  }
  auto impl = std::make_shared<Impl>();
  impl->id = next_mesh_id();
  impl->world = comm::world_group();
  impl->device_type = device_type;
  impl->shape = std::move(shape);
  impl->ranks = std::move(ranks);
  impl->names = std::move(dim_names);
  const int me = comm::get_rank();
  const int64_t nd = static_cast<int64_t>(impl->shape.size());
  std::vector<int64_t> strides(nd, 1);
  for (int64_t d = nd - 2; d >= 0; --d) strides[d] = strides[d + 1] * impl->shape[d + 1];
  for (int64_t i = 0; i < n; ++i) {
    if (impl->ranks[i] != me) continue;
    std::vector<int64_t> c(nd);
    for (int64_t d = 0; d < nd; ++d) c[d] = (i / strides[d]) % impl->shape[d];
    impl->coordinate = c;
  }
  // One group per mesh dim: all rows along dim d (every rank walks every row so that group
  // names stay in step across ranks).
  impl->groups.resize(nd);
  for (int64_t d = 0; d < nd; ++d) {
    const int64_t len = impl->shape[d];
    const int64_t rows = n / len;
    for (int64_t row = 0; row < rows; ++row) {
      // Row index enumerates the coordinates of all dims except d, row-major.
      std::vector<int> members;
      for (int64_t j = 0; j < len; ++j) {
        int64_t rest = row, flat = 0;
        for (int64_t e = nd - 1; e >= 0; --e) {
          int64_t c;
          if (e == d) {
            c = j;
          } else {
            c = rest % impl->shape[e];
            rest /= impl->shape[e];
          }
          flat += c * strides[e];
        }
        members.push_back(static_cast<int>(impl->ranks[flat]));
      }
      std::vector<int> sorted = members;
      std::sort(sorted.begin(), sorted.end());
      TORCH_CHECK(sorted == members,
                  "dtensor: mesh ranks must increase along every mesh dimension");
      auto g = comm::new_group(members, static_cast<int>(d));
      if (g) impl->groups[d] = g;
    }
  }
  impl->device = impl->coordinate ? local_device(device_type) : c10::Device(device_type);
  impl->root_dims.resize(nd);
  std::iota(impl->root_dims.begin(), impl->root_dims.end(), int64_t{0});
  impl->hash = hash_impl(*impl);
  impl_ = std::move(impl);
}

c10::DeviceType DeviceMesh::device_type() const { return impl_->device_type; }
std::string DeviceMesh::device_type_str() const {
  return c10::DeviceTypeName(impl_->device_type, /*lower_case=*/true);
}
c10::Device DeviceMesh::device() const { return impl_->device; }
const std::vector<int64_t>& DeviceMesh::shape() const { return impl_->shape; }
int64_t DeviceMesh::ndim() const { return static_cast<int64_t>(impl_->shape.size()); }
int64_t DeviceMesh::size(int64_t mesh_dim) const {
  TORCH_CHECK(mesh_dim >= 0 && mesh_dim < ndim(), "dtensor: mesh dim ", mesh_dim,
              " out of range for a ", ndim(), "-D mesh");
  return impl_->shape[mesh_dim];
}
int64_t DeviceMesh::size() const { return static_cast<int64_t>(impl_->ranks.size()); }
const std::vector<std::string>& DeviceMesh::dim_names() const { return impl_->names; }
bool DeviceMesh::has_dim_names() const { return !impl_->names.empty(); }
const std::vector<int64_t>& DeviceMesh::ranks() const { return impl_->ranks; }
const std::optional<std::vector<int64_t>>& DeviceMesh::coordinate() const {
  return impl_->coordinate;
}
uint64_t DeviceMesh::id() const { return impl_->id; }
size_t DeviceMesh::hash() const { return impl_->hash; }

int64_t DeviceMesh::dim_index(const std::string& name) const {
  for (size_t i = 0; i < impl_->names.size(); ++i) {
    if (impl_->names[i] == name) return static_cast<int64_t>(i);
  }
  TORCH_CHECK_INDEX(false, "Invalid mesh_dim_name '", name, "' specified. Valid mesh_dim_names: (",
                    join(impl_->names), ")");
}

int64_t DeviceMesh::get_local_rank(std::optional<int64_t> mesh_dim) const {
  TORCH_CHECK(mesh_dim.has_value() || ndim() == 1, "Found the DeviceMesh have ", ndim(),
              " dimensions. Optional kwarg `mesh_dim` needs to be specified when "
              "device_mesh.ndim > 1.");
  const int64_t d = mesh_dim.value_or(0);
  TORCH_CHECK(impl_->coordinate, "dtensor: rank ", comm::get_rank(), " is not part of ", str());
  return (*impl_->coordinate).at(d);
}

int64_t DeviceMesh::get_local_rank(const std::string& name) const {
  return get_local_rank(dim_index(name));
}

comm::ProcessGroup& DeviceMesh::group(int64_t mesh_dim) const {
  auto g = get_group(mesh_dim);
  return *g;
}

std::shared_ptr<comm::ProcessGroup> DeviceMesh::get_group(int64_t mesh_dim) const {
  size(mesh_dim);  // range check
  auto g = impl_->groups[mesh_dim];
  TORCH_CHECK(g, "dtensor: rank ", comm::get_rank(), " is not part of ", str(),
              " and has no group for mesh dim ", mesh_dim);
  return g;
}

std::shared_ptr<comm::ProcessGroup> DeviceMesh::get_group(const std::string& name) const {
  return get_group(dim_index(name));
}

DeviceMesh DeviceMesh::operator[](const std::string& name) const { return slice({name}); }

std::optional<DeviceMesh> mesh_for_role(const DeviceMesh& mesh, const std::string& role) {
  if (!mesh.has_dim_names()) {
    if (mesh.ndim() == 1) return mesh;
    return std::nullopt;
  }
  const auto& names = mesh.dim_names();
  if (std::find(names.begin(), names.end(), role) == names.end()) return std::nullopt;
  return mesh.ndim() == 1 ? mesh : mesh[role];
}

namespace {

// The sub-mesh of `parent` through this rank over its dims `dims`, in that order (any order:
// the ranks vary the listed dims row-major, the others stay at this rank's coordinate).
std::shared_ptr<const DeviceMesh::Impl> sub_mesh(
    const std::shared_ptr<const DeviceMesh::Impl>& parent, const std::vector<int64_t>& dims) {
  const DeviceMesh::Impl& p = *parent;
  auto child = std::make_shared<DeviceMesh::Impl>();
  child->id = next_mesh_id();
  child->world = p.world;
  child->device_type = p.device_type;
  child->device = p.device;
  child->root = p.root ? p.root : parent;
  const auto& coord = *p.coordinate;
  const int64_t nd = static_cast<int64_t>(p.shape.size());
  std::vector<int64_t> strides(nd, 1);
  for (int64_t d = nd - 2; d >= 0; --d) strides[d] = strides[d + 1] * p.shape[d + 1];
  std::vector<int64_t> child_coord;
  for (auto d : dims) {
    child->shape.push_back(p.shape[d]);
    if (!p.names.empty()) child->names.push_back(p.names[d]);
    child->groups.push_back(p.groups[d]);
    child->root_dims.push_back(p.root_dims[d]);
    child_coord.push_back(coord[d]);
  }
  const int64_t n =
      std::accumulate(child->shape.begin(), child->shape.end(), int64_t{1}, std::multiplies<>());
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t> c = coord;
    int64_t rest = i;
    for (int64_t k = static_cast<int64_t>(dims.size()) - 1; k >= 0; --k) {
      c[dims[k]] = rest % child->shape[k];
      rest /= child->shape[k];
    }
    int64_t flat = 0;
    for (int64_t d = 0; d < nd; ++d) flat += c[d] * strides[d];
    child->ranks.push_back(p.ranks[flat]);
  }
  child->coordinate = child_coord;
  child->hash = hash_impl(*child);
  return child;
}

}  // namespace

DeviceMesh DeviceMesh::slice(const std::vector<std::string>& names) const {
  TORCH_CHECK(has_dim_names(), "Cannot slice a DeviceMesh without mesh_dim_names!");
  std::vector<int64_t> dims;
  for (const auto& n : names) dims.push_back(dim_index(n));
  for (size_t i = 1; i < dims.size(); ++i) {
    TORCH_CHECK_INDEX(dims[i] > dims[i - 1], "Invalid mesh_dim_names (", join(names),
                      ") specified. Mesh dim indices should be in ascending order.");
  }
  if (dims.size() == impl_->shape.size()) return *this;
  TORCH_CHECK(impl_->coordinate, "dtensor: rank ", comm::get_rank(), " is not part of ", str(),
              " and cannot slice it");
  return DeviceMesh(sub_mesh(impl_, dims));
}

DeviceMesh DeviceMesh::concatenate(const std::vector<DeviceMesh>& meshes) {
  TORCH_CHECK(!meshes.empty(), "DeviceMesh::concatenate: no meshes given");
  const std::shared_ptr<const Impl> root =
      meshes[0].impl_->root ? meshes[0].impl_->root : meshes[0].impl_;
  std::vector<int64_t> dims;
  for (const DeviceMesh& m : meshes) {
    const auto& r = m.impl_->root ? m.impl_->root : m.impl_;
    TORCH_CHECK(r == root, "DeviceMesh::concatenate: ", m.str(), " and ", meshes[0].str(),
                " are not slices of one mesh; slice every part from the same init_device_mesh");
    for (int64_t d : m.impl_->root_dims) {
      TORCH_CHECK(std::find(dims.begin(), dims.end(), d) == dims.end(),
                  "DeviceMesh::concatenate: mesh dim ", d, " of ", DeviceMesh(root).str(),
                  " appears twice");
      dims.push_back(d);
    }
  }
  TORCH_CHECK(root->coordinate, "DeviceMesh::concatenate: rank ", comm::get_rank(),
              " is not part of ", DeviceMesh(root).str());
  if (meshes.size() == 1) return meshes[0];
  std::lock_guard<std::mutex> l(root->concatenated_mu);
  std::weak_ptr<const Impl>& cached = root->concatenated[dims];
  if (auto live = cached.lock()) return DeviceMesh(std::move(live));
  auto made = sub_mesh(root, dims);
  cached = made;
  return DeviceMesh(std::move(made));
}

bool DeviceMesh::operator==(const DeviceMesh& o) const {
  if (impl_ == o.impl_) return true;
  return impl_->hash == o.impl_->hash && impl_->world == o.impl_->world &&
         impl_->device_type == o.impl_->device_type && impl_->shape == o.impl_->shape &&
         impl_->ranks == o.impl_->ranks && impl_->names == o.impl_->names;
}

std::string DeviceMesh::str() const {
  std::ostringstream os;
  os << "DeviceMesh('" << device_type_str() << "', ";
  // Nested brackets over the shape.
  std::function<void(int64_t, int64_t)> rec = [&](int64_t d, int64_t off) {
    os << "[";
    int64_t stride = 1;
    for (int64_t e = d + 1; e < ndim(); ++e) stride *= impl_->shape[e];
    for (int64_t i = 0; i < impl_->shape[d]; ++i) {
      if (i) os << ", ";
      if (d + 1 == ndim()) {
        os << impl_->ranks[off + i];
      } else {
        rec(d + 1, off + i * stride);
      }
    }
    os << "]";
  };
  rec(0, 0);
  if (has_dim_names()) {
    os << ", mesh_dim_names=(" << join(impl_->names) << (impl_->names.size() == 1 ? ",)" : ")");
  }
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const DeviceMesh& m) { return os << m.str(); }

DeviceMesh init_device_mesh(const std::string& device_type, std::vector<int64_t> mesh_shape,
                            std::vector<std::string> mesh_dim_names) {
  TORCH_CHECK(device_type.find(':') == std::string::npos,
              "Device type with index is not supported ", "but got ", device_type,
              ". If you maintained a 'torch.device' object, it's "
              "recommended to pass in 'device.type'.");
  if (!mesh_dim_names.empty()) {
    TORCH_CHECK(mesh_dim_names.size() == mesh_shape.size(),
                "mesh_shape and mesh_dim_names should have same length!");
  }
  const c10::DeviceType type = c10::Device(device_type).type();
  comm::init_process_group();
  const int64_t n =
      std::accumulate(mesh_shape.begin(), mesh_shape.end(), int64_t{1}, std::multiplies<>());
  TORCH_CHECK(n <= comm::get_world_size(), "dtensor: mesh shape ", c10::IntArrayRef(mesh_shape),
              " needs ", n, " ranks but the world has ", comm::get_world_size());
  std::vector<int64_t> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  return DeviceMesh(type, std::move(mesh_shape), std::move(ranks), std::move(mesh_dim_names));
}

std::optional<DeviceMesh> current_mesh() {
  auto& s = mesh_stack();
  if (s.empty()) return std::nullopt;
  return s.back();
}

MeshGuard::MeshGuard(const DeviceMesh& mesh) { mesh_stack().push_back(mesh); }

MeshGuard::~MeshGuard() { mesh_stack().pop_back(); }

}  // namespace dtensor
