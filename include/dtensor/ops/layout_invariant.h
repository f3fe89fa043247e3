#pragma once
// Layout-invariant mode (first part: tensor parallelism's sums). While a LayoutInvariantMode
// lives on this thread, every sum over a sharded dim that tensor parallelism makes is taken in
// one canonical order whatever the number of ranks: a matrix product whose contracted dim is
// sharded (a row-parallel linear's forward, a column-parallel linear's input gradient), a sum or
// a vector norm over a sharded dim (sequence-parallel norm weights' gradients, the gradient norm
// for clipping) and the vocab-parallel loss's sums over the classes (label smoothing's too). The
// dim is cut into `max_degree` equal segments, each reduced alone (the same shapes on every layout,
// so the same bits), and the segments are added in a fixed binary tree: this rank's segments
// locally, then, after one all_gather of the ranks' subtotals, the rest of the tree in rank order.
// The result comes out Replicate, not pending, with an addmm's bias added after the whole sum. So a
// model parallelized at TP 1 (on a one-rank mesh), 2 or 4 trains and generates bit for bit alike,
// where all_reduce would add the ranks' partial sums in an order of the engine's choosing.
//
//   {
//     dtensor::ops::LayoutInvariantMode invariant(/*max_degree=*/4);
//     auto loss = F::cross_entropy(model->forward(tokens), targets);
//     loss.backward();   // keep the mode alive here too: backward's sums are covered
//     tp::reduce_partial_grads(*model);
//     nn::utils::clip_grad_norm_(model->parameters(), 1.0);
//   }
//
// Contract (float32 tested): the TP degree of the mesh dim being summed divides max_degree, a
// power of two; the summed dim divides into max_degree segments; column shards are at least 16
// wide (narrower ones take another kernel path in this LibTorch). It costs one all_gather per
// sum instead of an all_reduce, and max_degree smaller products. nn::utils::clip_grad_norm_ takes
// its own canonical sum in the mode, which also covers FSDP's leaves over at most 2 ranks; FSDP's
// reduce-scatter adds two ranks' gradients exactly alike in either order, so a trainer that cuts
// its batch into 2 segments everywhere (dtensor_train does) is invariant at dp_shard 1 and 2 too,
// and with pipeline stages whose micro-batches are those segments (the gradient norm gathers the
// stages' sums in stage order; scaling a micro-batch's loss by 1/2 is exact).
// models::generate in the mode also gives each decode step the bits of a fresh prefill of the
// whole sequence (the decoder's products and cached attention take shapes that make it so).
// Not yet: replicated KV projections' gradient sums, FSDP over more than 2 ranks.
// dtensor_train and dtensor_generate take it as --layout-invariant P.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string_view>

#include "dtensor/dispatch/op_call.h"
#include "dtensor/mesh/device_mesh.h"

namespace dtensor::ops {

/// The mode's product of a contracted dim split over the `k` ranks of `mesh`'s dim `mesh_dim`
/// (k = 1 without a mesh): `a` (M, K/k) and `b` (K/k, N) are this rank's parts; returns the
/// whole (M, N) product, the same bits on every rank and at every k. What the mode's mm and
/// addmm compute, for code that holds local tensors (generation's decoder). Needs the mode.
at::Tensor canonical_mm(const at::Tensor& a, const at::Tensor& b, const DeviceMesh* mesh = nullptr,
                        int64_t mesh_dim = 0, std::string_view op = "aten::mm");

/// The mode's sum over dim `dim` of `local`, this rank's part of a dim split over the ranks of
/// `mesh`'s dim `mesh_dim` (one rank without a mesh): `partial(segment)` gives each segment's
/// contribution (the same reduction for every segment, so the same shape), and the contributions
/// are added in the mode's tree, then over the ranks. The same bits on every rank and at every
/// degree. Needs the mode.
at::Tensor canonical_reduce(const at::Tensor& local, int64_t dim,
                            const std::function<at::Tensor(const at::Tensor&)>& partial,
                            const DeviceMesh* mesh = nullptr, int64_t mesh_dim = 0,
                            std::string_view op = "aten::sum");

/// The decision-context bit LayoutInvariantMode sets (see dispatch::decision_context()).
inline constexpr int64_t kLayoutInvariantBit = int64_t{1} << 1;

/// The number of segments of the mode active on this thread; 0 when it is off.
int64_t layout_invariant_segments();

/// Guard enabling the layout-invariant sums on this thread (see above).
class LayoutInvariantMode {
 public:
  /// Turns the mode on with `max_degree` segments (a power of two, at least 1).
  explicit LayoutInvariantMode(int64_t max_degree = 4);
  /// Restores the previous setting.
  ~LayoutInvariantMode();
  LayoutInvariantMode(const LayoutInvariantMode&) = delete;
  LayoutInvariantMode& operator=(const LayoutInvariantMode&) = delete;

 private:
  dispatch::DecisionContextGuard guard_;
  int64_t prev_;
};

}  // namespace dtensor::ops
