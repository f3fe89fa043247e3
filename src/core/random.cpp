#include "dtensor/core/random.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "dtensor/util/hash.h"

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

// Called with s.mu held.
void seed_if_needed(RngState& s) {
  if (!s.seeded) {
    s.seed = at::detail::getDefaultCPUGenerator().current_seed();
    s.seeded = true;
  }
}

std::pair<uint64_t, uint64_t> reserve_counters(uint64_t n) {
  auto& s = rng();
  std::lock_guard<std::mutex> l(s.mu);
  seed_if_needed(s);
  const uint64_t first = s.offset;
  s.offset += (n + 3) / 4 * 4;
  return {s.seed, first};
}

// SplitMix64's mix of the seed and the element's counter: a counter-based generator, so any
// element is computable on its own.
inline double uniform01(uint64_t seed, uint64_t counter) {
  using util::splitmix64_mix;
  const uint64_t x = splitmix64_mix(seed * util::kSplitMix64Gamma +
                                    splitmix64_mix(counter + 0x632be59bd9b4e019ull));
  return static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
}

// Values of the elements of `shape` (a block at `offset` of a `global` tensor).
at::Tensor generate(c10::IntArrayRef global, c10::IntArrayRef shape, c10::IntArrayRef offset,
                    bool normal, uint64_t seed, uint64_t first, at::TensorOptions options) {
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
    if (!normal) {
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

}  // namespace

void manual_seed(uint64_t seed) {
  auto& s = rng();
  std::lock_guard<std::mutex> l(s.mu);
  s.seeded = true;
  s.seed = seed;
  s.offset = 0;
}

namespace random {

StreamState get_state() {
  auto& s = rng();
  std::lock_guard<std::mutex> l(s.mu);
  seed_if_needed(s);
  return {s.seed, s.offset};
}

void set_state(const StreamState& state) {
  auto& s = rng();
  std::lock_guard<std::mutex> l(s.mu);
  s.seeded = true;
  s.seed = state.seed;
  s.offset = state.offset;
}

Draw reserve(int64_t numel) {
  // Two counters per element, so normal draws (Box-Muller) have their own pair.
  auto [seed, first] = reserve_counters(static_cast<uint64_t>(numel) * 2);
  return Draw{seed, first / 2};
}

at::Tensor uniform_block(const Draw& d, c10::IntArrayRef global_shape, c10::IntArrayRef shape,
                         c10::IntArrayRef offset, at::TensorOptions options) {
  return generate(global_shape, shape, offset, false, d.seed, d.first, options);
}

at::Tensor normal_block(const Draw& d, c10::IntArrayRef global_shape, c10::IntArrayRef shape,
                        c10::IntArrayRef offset, at::TensorOptions options) {
  return generate(global_shape, shape, offset, true, d.seed, d.first, options);
}

}  // namespace random
}  // namespace dtensor
