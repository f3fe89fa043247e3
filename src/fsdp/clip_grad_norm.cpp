// clip_grad_norm_: see include/dtensor/nn/clip_grad.h.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/dispatch/implicit_replication.h"
#include "dtensor/fsdp/fully_shard.h"
#include "dtensor/nn/clip_grad.h"
#include "dtensor/ops/layout_invariant.h"

namespace dtensor::nn::utils {
namespace {

using GroupList = std::vector<std::shared_ptr<comm::ProcessGroup>>;

// The groups of the mesh dims (of more than one rank) a gradient's placements shard it over:
// none for a plain or replicated one. Partial gradients are refused.
GroupList groups_sharding(const at::Tensor& grad) {
  GroupList over;
  if (!is_dtensor(grad)) return over;
  const DTensorSpec& spec = spec_of(grad);
  TORCH_CHECK(!spec.has_partial(), "clip_grad_norm_: a gradient has placements ",
              to_string(spec.placements()),
              "; reduce Partial gradients first (models::reduce_partial_grads)");
  for (int64_t d = 0; d < spec.mesh().ndim(); ++d)
    if (spec.placements()[d].is_shard() && spec.mesh().size(d) > 1)
      over.push_back(spec.mesh().get_group(d));
  return over;
}

// Every group of `lists` once, in the order first met (the same on every rank of a group: its
// ranks hold the same parameters in the same order).
template <class T>
GroupList distinct_groups(const std::vector<T>& items, GroupList T::*lists) {
  GroupList groups;
  for (const auto& item : items)
    for (const auto& g : item.*lists)
      if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  return groups;
}

// Squared gradient sums, one per set of groups they are summed over: the mesh dims a
// gradient's placements shard it over (more than one rank); none for a replicated or plain one.
struct SquareSums {
  struct Bucket {
    GroupList over;
    at::Tensor sum;  // 0-d float64 on the gradients' device
  };
  std::vector<Bucket> buckets;

  void add(const at::Tensor& grad) {
    GroupList over = groups_sharding(grad);
    const at::Tensor local = is_dtensor(grad) ? local_tensor(grad) : grad;
    Bucket* b = nullptr;
    for (auto& x : buckets)
      if (x.over == over) b = &x;
    if (!b) b = &buckets.emplace_back(Bucket{std::move(over)});
    const at::Tensor squares = local.to(at::kDouble).pow(2).sum();
    b->sum = b->sum.defined() ? b->sum + squares : squares;
  }

  // The global sum of squares: per group (in the order first met, the same on every rank of
  // it), one all_reduce of the buckets summed over it.
  at::Tensor total() {
    for (const auto& g : distinct_groups(buckets, &Bucket::over)) {
      std::vector<Bucket*> in;
      for (auto& b : buckets)
        if (std::find(b.over.begin(), b.over.end(), g) != b.over.end()) in.push_back(&b);
      std::vector<at::Tensor> sums;
      for (auto* b : in) sums.push_back(b->sum);
      const at::Tensor reduced = comm::all_reduce(at::stack(sums), ReduceOp::Sum, *g);
      for (size_t i = 0; i < in.size(); ++i) in[i]->sum = reduced[static_cast<int64_t>(i)];
    }
    at::Tensor t = buckets.front().sum;
    for (size_t i = 1; i < buckets.size(); ++i) t = t + buckets[i].sum;
    return t;
  }
};

// The layout-invariant mode's sum of squares (P = the mode's segments): each gradient cut into a
// fixed grid of blocks - dim 0 into 2P rows of blocks (TP's and FSDP's splits of dim 0 for
// a TP degree dividing P and a dp degree of at most 2, FSDP's nested in TP's), the last dim of
// a matrix into P - each block's squares summed alone in float64 (the same block shapes at
// every layout, so the same bits), the ranks' blocks exchanged by one all_gather per group a
// gradient is sharded over, then a fixed binary tree over each gradient's blocks. Returns one
// sum per gradient (0-d float64 on its device), in order: the same bits at every layout the grid
// allows.
std::vector<at::Tensor> canonical_squares(const std::vector<at::Tensor>& params, int64_t segments) {
  struct Grid {
    int64_t rows = 1, cols = 1;  // blocks along dim 0 and the last dim
    at::Tensor blocks;           // [rows * cols] float64; -1 where another rank holds the block
    GroupList over;
  };
  std::vector<Grid> grids;
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    Grid grid;
    const std::vector<int64_t> shape = g.sizes().vec();
    at::Tensor local = g;
    std::vector<int64_t> offset(shape.size(), 0), extent = shape;
    grid.over = groups_sharding(g);
    if (is_dtensor(g)) {
      const LocalShard mine = spec_of(g).local_shard();
      offset = mine.offset;
      extent = mine.shape;
      local = local_tensor(g);
    }
    const int64_t nd = static_cast<int64_t>(shape.size());
    if (nd >= 1) grid.rows = 2 * segments;
    if (nd >= 2) grid.cols = segments;
    const int64_t last = std::max<int64_t>(nd - 1, 0);
    const int64_t row_len = nd >= 1 ? shape[0] / grid.rows : 1;
    const int64_t col_len = nd >= 2 ? shape[last] / grid.cols : 1;
    auto aligned = [](int64_t x, int64_t len) { return len > 0 && x % len == 0; };
    TORCH_CHECK(
        nd == 0 || (shape[0] % grid.rows == 0 && (nd < 2 || shape[last] % grid.cols == 0) &&
                    aligned(offset[0], row_len) && aligned(extent[0], row_len) &&
                    (nd < 2 || (aligned(offset[last], col_len) && aligned(extent[last], col_len)))),
        "clip_grad_norm_ in LayoutInvariantMode(", segments, "): a gradient of shape ",
        c10::IntArrayRef(shape), " does not split into the mode's blocks (", grid.rows,
        " along dim 0",
        nd >= 2 ? ", " + std::to_string(grid.cols) + " along the last" : std::string(),
        ") with this rank's part inside whole blocks");
    grid.blocks = at::full({grid.rows * grid.cols}, -1.0, local.options().dtype(at::kDouble));
    const int64_t r0 = nd >= 1 ? offset[0] / row_len : 0;
    const int64_t nr = nd >= 1 ? extent[0] / row_len : 1;
    const int64_t c0 = nd >= 2 ? offset[last] / col_len : 0;
    const int64_t nc = nd >= 2 ? extent[last] / col_len : 1;
    for (int64_t r = 0; r < nr; ++r) {
      for (int64_t c = 0; c < nc; ++c) {
        at::Tensor block = local;
        if (nd >= 1) block = block.narrow(0, r * row_len, row_len);
        if (nd >= 2) block = block.narrow(last, c * col_len, col_len);
        grid.blocks.select(0, (r0 + r) * grid.cols + c0 + c)
            .copy_(block.contiguous().to(at::kDouble).pow(2).sum());
      }
    }
    grids.push_back(std::move(grid));
  }
  // Each group once: every rank gets the blocks its peers hold.
  for (const auto& group : distinct_groups(grids, &Grid::over)) {
    std::vector<Grid*> in;
    for (auto& grid : grids)
      if (std::find(grid.over.begin(), grid.over.end(), group) != grid.over.end())
        in.push_back(&grid);
    std::vector<at::Tensor> mine;
    for (auto* grid : in) mine.push_back(grid->blocks);
    // A block is held by one rank of the group (the others: -1), so the maximum is its value.
    const at::Tensor all =
        comm::all_gather_into_tensor(at::cat(mine), 0, *group).view({group->size(), -1}).amax(0);
    int64_t at = 0;
    for (auto* grid : in) {
      grid->blocks = all.narrow(0, at, grid->blocks.numel()).clone();
      at += grid->blocks.numel();
    }
  }
  std::vector<at::Tensor> sums;
  for (const auto& grid : grids) {
    // Checked on the device: every block was held by some rank.
    at::_assert_async(grid.blocks.min() >= 0, "clip_grad_norm_: a block of the grid is missing");
    at::Tensor level = grid.blocks;  // a power of two long: 2P x P
    while (level.numel() > 1) {
      const auto pairs = level.view({-1, 2});
      level = pairs.select(1, 0) + pairs.select(1, 1);
    }
    sums.push_back(level.reshape({}));
  }
  return sums;
}

// The stages' per-gradient sums one after the other, stage 0's first, on every stage: the
// whole model's gradients in their one-device order when each stage holds a run of them.
std::vector<double> in_stage_order(const std::vector<double>& mine, comm::ProcessGroup& stages) {
  const at::Tensor counts = comm::all_gather_into_tensor(
      at::full({1}, static_cast<double>(mine.size()), at::kDouble), 0, stages);
  const auto longest = static_cast<int64_t>(counts.max().item<double>());
  at::Tensor padded = at::zeros({longest}, at::kDouble);
  if (!mine.empty())
    padded.narrow(0, 0, static_cast<int64_t>(mine.size())).copy_(at::tensor(mine, at::kDouble));
  const at::Tensor all = comm::all_gather_into_tensor(padded, 0, stages).cpu().contiguous();
  const at::Tensor n = counts.cpu().contiguous();
  std::vector<double> out;
  for (int64_t r = 0; r < stages.size(); ++r) {
    const double* row = all.const_data_ptr<double>() + r * longest;
    out.insert(out.end(), row, row + static_cast<int64_t>(n.const_data_ptr<double>()[r]));
  }
  return out;
}

}  // namespace

at::Tensor clip_grad_norm_on_device_(const std::vector<at::Tensor>& params, double max_norm,
                                     const ClipGradNormOptions& options) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> counted;
  bool all_counted_here = true;
  bool any_shard = false;
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    if (options.counted_elsewhere && options.counted_elsewhere(p)) {
      all_counted_here = false;
      continue;
    }
    counted.push_back(p);
    any_shard = any_shard || fsdp::is_fsdp_shard(p);
  }
  auto device_of = [&] {
    if (grads.empty()) return at::TensorOptions(at::kDouble);
    const at::Tensor& g = grads.front();
    return at::TensorOptions(at::kDouble).device((is_dtensor(g) ? local_tensor(g) : g).device());
  };
  // The squares of this rank's share of the norm (float64), or the norm itself where LibTorch's
  // own arithmetic gives it (one mesh, everything counted here, no stages).
  at::Tensor squares, norm;
  const int64_t segments = ops::layout_invariant_segments();
  if (segments > 0) {
    std::vector<at::Tensor> sums = canonical_squares(counted, segments);
    if (options.stage_group) {
      // The stages' sums are exchanged and ordered on the host (a pipeline step is not captured).
      std::vector<double> host;
      for (const auto& x : sums) host.push_back(x.item<double>());
      host = in_stage_order(host, *options.stage_group);
      double total = 0;
      for (double x : host) total += x;  // in order, as one device adds them
      squares = at::scalar_tensor(total, device_of());
    } else {
      // In order, as one device adds them.
      squares = at::zeros({}, device_of());
      for (const auto& x : sums) squares = squares + x;
    }
  } else if (any_shard) {
    // FSDP's leaves live on their own meshes ("dp", or (tp, dp)): their squares are summed over
    // the groups their placements shard them over.
    SquareSums sums;
    for (const at::Tensor& p : counted) sums.add(p.grad());
    squares = sums.buckets.empty() ? at::zeros({}, device_of()) : sums.total();
  } else if (!counted.empty()) {
    // DTensors (one mesh) and plain tensors: LibTorch's clip_grad_norm_ arithmetic (norms in the
    // gradients' dtype); DTensor norms reduce a pending p-norm over the sharded dims in the one
    // all_reduce that replicates the total.
    ImplicitReplication plain_gradients_are_replicated;
    std::vector<at::Tensor> norms;
    for (const at::Tensor& p : counted) norms.push_back(p.grad().norm(2));
    at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2);
    if (is_dtensor(total))
      total = local_tensor(redistribute(total, replicate_all(spec_of(total).mesh().ndim())));
    if (options.stage_group || !all_counted_here)
      squares = total.to(at::kDouble).pow(2);
    else
      norm = total;
  } else {
    squares = at::zeros({}, device_of());
  }
  if (!norm.defined()) {
    if (options.stage_group && segments == 0)
      squares =
          comm::all_reduce(squares.reshape({1}), ReduceOp::Sum, *options.stage_group).reshape({});
    norm = squares.sqrt();
  }
  // min(1, max_norm / (norm + 1e-6)) on the device: a factor of 1 leaves the gradients as they
  // are.
  const at::Tensor coef = at::clamp(max_norm / (norm + 1e-6), std::nullopt, 1.0);
  for (auto& g : grads) g.mul_(coef);
  return norm;
}

double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                       const ClipGradNormOptions& options) {
  return clip_grad_norm_on_device_(params, max_norm, options).item<double>();
}

}  // namespace dtensor::nn::utils
