#pragma once
// DTensor's random stream: counter-based, so every element's value depends only on
// (seed, draw offset, global linear index). Replicas draw equal numbers, shards disjoint ones,
// and a sharded draw equals the single-device draw of the whole tensor. All ranks must make
// the same sequence of draws (SPMD), as for collectives.
#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>

namespace dtensor {

/// Seeds the stream (use the same seed on every rank). Until called, the seed is the CPU
/// default generator's initial seed.
void manual_seed(uint64_t seed);

namespace random {

/// One reserved draw: the seed and its first counter.
struct Draw {
  uint64_t seed;   ///< Seed of the stream when the draw was reserved.
  uint64_t first;  // first counter of this draw
};
/// Where the stream stands: its seed and the next counter to reserve.
struct StreamState {
  uint64_t seed;    ///< Seed of the stream.
  uint64_t offset;  ///< First counter of the next draw.
};
/// The current state (seeding the stream first if manual_seed was never called).
StreamState get_state();
/// Puts the stream back to `state` (a recomputation replays the draws of the original).
void set_state(const StreamState& state);

/// Reserves the counters of one draw over a tensor of `numel` elements (every rank calls it).
Draw reserve(int64_t numel);

/// Uniform [0, 1) / standard normal values of the block `shape` at `offset` of a tensor of
/// `global_shape`, for draw `d`. Computed on the CPU in double, returned with `options`.
at::Tensor uniform_block(const Draw& d, c10::IntArrayRef global_shape, c10::IntArrayRef shape,
                         c10::IntArrayRef offset, at::TensorOptions options);
/// Standard normal values of the block, as uniform_block describes.
at::Tensor normal_block(const Draw& d, c10::IntArrayRef global_shape, c10::IntArrayRef shape,
                        c10::IntArrayRef offset, at::TensorOptions options);

}  // namespace random
}  // namespace dtensor
