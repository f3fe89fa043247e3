#include "dtensor/core/factories.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include "dtensor/core/random.h"

namespace dtensor {
namespace {

at::TensorOptions local_options(at::TensorOptions o, const DeviceMesh& mesh) {
  if (!o.has_dtype()) o = o.dtype(at::kFloat);
  return o.device(mesh.device()).requires_grad(false);
}

at::Tensor wrap(at::Tensor local, at::IntArrayRef size, const DeviceMesh& mesh, const Placements& p,
                at::TensorOptions options) {
  TensorMeta meta{size.vec(), default_strides(size), local.scalar_type()};
  at::Tensor out = make_dtensor(std::move(local), make_spec(mesh, p, std::move(meta)));
  if (options.requires_grad()) out.set_requires_grad(true);
  return out;
}

template <typename F>
at::Tensor create(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                  at::TensorOptions options, const char* api, F&& make_local) {
  Placements p = normalize_placements(placements, static_cast<int64_t>(size.size()), mesh, api);
  for (const auto& x : p) {
    TORCH_CHECK(!x.is_partial(), api, ": cannot create a Partial DTensor; use from_local");
  }
  LocalShard shard{{0}, {}};
  if (mesh.contains_this_rank()) {
    shard = compute_local_shape_and_global_offset(size, mesh.shape(), *mesh.coordinate(), p);
  }
  return wrap(make_local(shard, local_options(options, mesh)), size, mesh, p, options);
}

enum class Dist { Uniform, Normal };

at::Tensor random_factory(at::IntArrayRef size, const DeviceMesh& mesh,
                          c10::ArrayRef<Placement> placements, at::TensorOptions options, Dist dist,
                          const char* api) {
  int64_t numel = 1;
  for (auto s : size) numel *= s;
  // Every rank reserves the whole tensor's counters, so the streams stay in step.
  const random::Draw d = random::reserve(numel);
  return create(
      size, mesh, placements, options, api, [&](const LocalShard& s, at::TensorOptions o) {
        if (!mesh.contains_this_rank()) return at::empty({0}, o);
        return dist == Dist::Normal ? random::normal_block(d, size, s.shape, s.offset, o)
                                    : random::uniform_block(d, size, s.shape, s.offset, o);
      });
}

}  // namespace

at::Tensor empty(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                 at::TensorOptions options) {
  return create(size, mesh, placements, options, "dtensor::empty",
                [](const LocalShard& s, at::TensorOptions o) { return at::empty(s.shape, o); });
}

at::Tensor full(at::IntArrayRef size, const at::Scalar& value, const DeviceMesh& mesh,
                c10::ArrayRef<Placement> placements, at::TensorOptions options) {
  return create(
      size, mesh, placements, options, "dtensor::full",
      [&](const LocalShard& s, at::TensorOptions o) { return at::full(s.shape, value, o); });
}

at::Tensor zeros(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                 at::TensorOptions options) {
  return full(size, 0, mesh, placements, options);
}

at::Tensor ones(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                at::TensorOptions options) {
  return full(size, 1, mesh, placements, options);
}

at::Tensor rand(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                at::TensorOptions options) {
  return random_factory(size, mesh, placements, options, Dist::Uniform, "dtensor::rand");
}

at::Tensor randn(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                 at::TensorOptions options) {
  return random_factory(size, mesh, placements, options, Dist::Normal, "dtensor::randn");
}

at::Tensor rand_global(at::IntArrayRef size, at::TensorOptions options) {
  int64_t numel = 1;
  for (auto s : size) numel *= s;
  return random::uniform_block(random::reserve(numel), size, size,
                               std::vector<int64_t>(size.size(), 0), options);
}

at::Tensor randn_global(at::IntArrayRef size, at::TensorOptions options) {
  int64_t numel = 1;
  for (auto s : size) numel *= s;
  return random::normal_block(random::reserve(numel), size, size,
                              std::vector<int64_t>(size.size(), 0), options);
}

}  // namespace dtensor
