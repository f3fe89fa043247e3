#include "dtensor/core/factories.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <mutex>

namespace dtensor {
namespace {

struct RngState {
  std::mutex mu;
  bool seeded = false;
  uint64_t seed = 0;
  uint64_t offset = 0;
};
RngState& rng() {
  static RngState s;
  return s;
}

// Reserves `n` counters of the stream; returns (seed, first counter).
std::pair<uint64_t, uint64_t> reserve(uint64_t n) {
  auto& s = rng();
  std::lock_guard<std::mutex> l(s.mu);
  if (!s.seeded) {
    s.seed = at::detail::getDefaultCPUGenerator().current_seed();
    s.seeded = true;
  }
  const uint64_t first = s.offset;
  s.offset += (n + 3) / 4 * 4;
  return {s.seed, first};
}

// SplitMix64 finaliser: a counter-based generator, so any element is computable on its own.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline double uniform01(uint64_t seed, uint64_t counter) {
  const uint64_t x = mix64(seed * 0x9e3779b97f4a7c15ull + mix64(counter + 0x632be59bd9b4e019ull));
  return static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
}

enum class Dist { Uniform, Normal };

// Values of the elements of `shape` (a block at `offset` of a `global` tensor).
at::Tensor generate(c10::IntArrayRef global, c10::IntArrayRef shape, c10::IntArrayRef offset,
                    Dist dist, uint64_t seed, uint64_t first, at::TensorOptions options) {
  const int64_t nd = static_cast<int64_t>(global.size());
  std::vector<int64_t> gstride(nd, 1);
  for (int64_t d = nd - 2; d >= 0; --d) gstride[d] = gstride[d + 1] * global[d + 1];
  auto out = at::empty(shape, at::TensorOptions().dtype(at::kDouble));
  double* p = out.data_ptr<double>();
  const int64_t n = out.numel();
  std::vector<int64_t> idx(nd, 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t g = 0;
    for (int64_t d = 0; d < nd; ++d) g += (offset[d] + idx[d]) * gstride[d];
    const uint64_t c = first + static_cast<uint64_t>(g);
    if (dist == Dist::Uniform) {
      p[i] = uniform01(seed, c);
    } else {
      // Box-Muller on two independent draws of this element's counter.
      const double u1 = 1.0 - uniform01(seed, 2 * c);
      const double u2 = uniform01(seed ^ 0x5851f42d4c957f2dull, 2 * c + 1);
      p[i] = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    }
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  const auto dtype = options.has_dtype() ? options.dtype().toScalarType() : at::kFloat;
  const auto device = options.has_device() ? options.device() : at::Device(at::kCPU);
  return out.to(device, dtype);
}

at::TensorOptions local_options(at::TensorOptions o, const DeviceMesh& mesh) {
  if (!o.has_dtype()) o = o.dtype(at::kFloat);
  return o.device(mesh.device()).requires_grad(false);
}

at::Tensor wrap(at::Tensor local, at::IntArrayRef size, const DeviceMesh& mesh,
                const Placements& p, at::TensorOptions options) {
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

at::Tensor random(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                  at::TensorOptions options, Dist dist, const char* api) {
  int64_t numel = 1;
  for (auto s : size) numel *= s;
  // Every rank reserves the whole tensor's counters, so the streams stay in step.
  auto [seed, first] = reserve(static_cast<uint64_t>(numel) * (dist == Dist::Normal ? 2 : 1));
  if (dist == Dist::Normal) first /= 2;  // counters 2c, 2c+1 lie inside the reservation
  return create(size, mesh, placements, options, api, [&](const LocalShard& s, at::TensorOptions o) {
    if (!mesh.contains_this_rank()) return at::empty({0}, o);
    return generate(size, s.shape, s.offset, dist, seed, first, o);
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
  return create(size, mesh, placements, options, "dtensor::full",
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
  return random(size, mesh, placements, options, Dist::Uniform, "dtensor::rand");
}

at::Tensor randn(at::IntArrayRef size, const DeviceMesh& mesh, c10::ArrayRef<Placement> placements,
                 at::TensorOptions options) {
  return random(size, mesh, placements, options, Dist::Normal, "dtensor::randn");
}

void manual_seed(uint64_t seed) {
  auto& s = rng();
  std::lock_guard<std::mutex> l(s.mu);
  s.seeded = true;
  s.seed = seed;
  s.offset = 0;
}

at::Tensor rand_global(at::IntArrayRef size, at::TensorOptions options) {
  int64_t numel = 1;
  for (auto s : size) numel *= s;
  auto [seed, first] = reserve(static_cast<uint64_t>(numel));
  return generate(size, size, std::vector<int64_t>(size.size(), 0), Dist::Uniform, seed, first, options);
}

at::Tensor randn_global(at::IntArrayRef size, at::TensorOptions options) {
  int64_t numel = 1;
  for (auto s : size) numel *= s;
  auto [seed, first] = reserve(static_cast<uint64_t>(numel) * 2);
  return generate(size, size, std::vector<int64_t>(size.size(), 0), Dist::Normal, seed, first / 2,
                  options);
}

}  // namespace dtensor
