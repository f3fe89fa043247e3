#include "dtensor/core/redistribute.h"

#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace dtensor {
namespace {

// Pads `t` with zeros at the end of `dim` up to `size`.
at::Tensor pad_to(const at::Tensor& t, int64_t dim, int64_t size) {
  const int64_t have = t.size(dim);
  if (have == size) return t;
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape[dim] = size - have;
  return at::cat({t, at::zeros(shape, t.options())}, dim);
}

// Size of tensor dim `d` as seen by mesh dim `mesh_dim`: the global size split by every
// earlier mesh dim that currently shards `d`.
int64_t logical_size(const DTensorSpec& spec, c10::ArrayRef<Placement> current, int64_t mesh_dim,
                     int64_t d) {
  int64_t n = spec.shape()[d];
  const auto& coord = *spec.mesh().coordinate();
  for (int64_t j = 0; j < mesh_dim; ++j) {
    if (current[j].is_shard(d)) n = chunk_range(n, spec.mesh().size(j), coord[j]).size;
  }
  return n;
}

// S(d) -> R: pad to the full chunk, gather, trim.
comm::PendingResult shard_to_replicate(const at::Tensor& local, int64_t d, int64_t n,
                                       comm::ProcessGroup& pg, bool async) {
  const int64_t k = pg.size();
  const int64_t c = full_chunk_size(n, k);
  auto p = comm::all_gather_into_tensor_async(pad_to(local, d, c), d, pg);
  if (c * k != n) p.then([d, n](at::Tensor x) { return x.narrow(d, 0, n).contiguous(); });
  if (!async) p.wait();
  return p;
}

// P -> R: all-reduce (a pending p-norm sums the p-th powers, then takes the root).
comm::PendingResult partial_to_replicate(const at::Tensor& t, const Placement& from,
                                         comm::ProcessGroup& pg, bool async) {
  const double p = from.norm_p();
  comm::PendingResult pending({}, t, nullptr, "");
  if (p != 0.0 && std::isfinite(p)) {
    pending = comm::all_reduce_async(t.abs().pow(p), ReduceOp::Sum, pg);
    pending.then([p](at::Tensor x) { return x.pow(1.0 / p); });
  } else {
    pending = comm::all_reduce_async(t, from.reduce_op(), pg);
  }
  if (!async) pending.wait();
  return pending;
}

// R -> P: the local value that reduces to `t` over the k ranks (no communication). Gradients
// (is_backward) keep the replica.
at::Tensor replicate_to_partial(const at::Tensor& t, const Placement& to, int64_t k,
                                bool is_backward) {
  if (is_backward) return t;
  switch (to.reduce_op()) {
    case ReduceOp::Sum:  // summing k copies (of p-th powers for a norm) gives the value
      return to.is_norm_partial() ? t / std::pow(static_cast<double>(k), 1.0 / to.norm_p()) : t / k;
    case ReduceOp::Avg:
    case ReduceOp::Max:
    case ReduceOp::Min:
      return t;  // reducing identical copies is the identity
    case ReduceOp::Product:
      break;
  }
  TORCH_CHECK(false, "dtensor: redistributing to ", to.str(),
              " is not supported (only to Partial(sum|avg|max|min)); replicate instead");
}

}  // namespace

namespace {

// A chunk of a dense CPU tensor copied with memcpy: one block per index of the dims before
// `dim`. Skips narrow() and clone()'s TensorIterator, which cost several microseconds, a
// sizeable share of the copy itself at ~1 MiB. Large chunks with several intra-op threads keep
// clone(), which copies in parallel.
bool can_copy_chunk_directly(const at::Tensor& t) {
  if (!t.device().is_cpu() || t.layout() != c10::kStrided || !t.is_contiguous() || t.is_conj() ||
      t.is_neg() || t.is_quantized()) {
    return false;
  }
  if (c10::GradMode::is_enabled() && t.requires_grad()) return false;  // keep the graph
  return at::get_num_threads() == 1 || t.nbytes() <= (size_t{4} << 20);
}

at::Tensor copy_chunk_directly(const at::Tensor& t, int64_t dim, int64_t offset, int64_t size) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape[dim] = size;
  at::Tensor out = at::empty(shape, t.options());
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= t.size(d);
  for (int64_t d = dim + 1; d < t.dim(); ++d) inner *= t.size(d);
  const size_t item = t.element_size();
  const size_t block = static_cast<size_t>(size * inner) * item;
  if (block == 0) return out;
  const auto* src =
      static_cast<const char*>(t.const_data_ptr()) + static_cast<size_t>(offset * inner) * item;
  auto* dst = static_cast<char*>(out.mutable_data_ptr());
  const size_t src_row = static_cast<size_t>(t.size(dim) * inner) * item;
  for (int64_t o = 0; o < outer; ++o) std::memcpy(dst + o * block, src + o * src_row, block);
  return out;
}

}  // namespace

at::Tensor local_chunk(const at::Tensor& t, int64_t dim, int64_t k, int64_t r) {
  const ShardRange rg = chunk_range(t.size(dim), k, r);
  const int64_t offset = rg.size == 0 ? t.size(dim) : rg.offset;
  if (can_copy_chunk_directly(t)) return copy_chunk_directly(t, dim, offset, rg.size);
  return t.narrow(dim, offset, rg.size).clone();
}

Placements backward_target(c10::ArrayRef<Placement> p) { return clear_partial(p); }

std::vector<RedistributeStep> plan_redistribute(c10::ArrayRef<Placement> src,
                                                c10::ArrayRef<Placement> dst) {
  TORCH_CHECK(src.size() == dst.size(), "dtensor: redistribute between ", src.size(), " and ",
              dst.size(), " placements");
  struct KeyHash {
    size_t operator()(const std::pair<Placements, Placements>& k) const {
      size_t h = k.first.size();
      for (const auto& p : k.first) h = h * 31 + p.hash();
      for (const auto& p : k.second) h = h * 37 + p.hash();
      return h;
    }
  };
  thread_local std::unordered_map<std::pair<Placements, Placements>, std::vector<RedistributeStep>,
                                  KeyHash>
      cache;
  auto key = std::make_pair(Placements(src.begin(), src.end()), Placements(dst.begin(), dst.end()));
  if (auto it = cache.find(key); it != cache.end()) return it->second;

  std::vector<RedistributeStep> steps;
  Placements cur(src.begin(), src.end());
  const int64_t nd = static_cast<int64_t>(src.size());
  bool any_shard = false;
  for (const auto& p : src) any_shard |= p.is_shard();
  if (nd > 1 && any_shard) {
    // Inner mesh dims first: a target shard whose outer sharding of the same tensor dim differs
    // between now and the target is replicated for the time being.
    for (int64_t i = nd - 1; i >= 0; --i) {
      Placement target = dst[i];
      if (target.is_shard()) {
        const int64_t d = target.dim();
        std::vector<int64_t> now, want;
        for (int64_t j = 0; j < i; ++j) {
          if (cur[j].is_shard(d)) now.push_back(j);
          if (dst[j].is_shard(d)) want.push_back(j);
        }
        if (now != want) target = Replicate();
      }
      if (cur[i] != target) {
        steps.push_back({i, cur[i], target});
        cur[i] = target;
      }
    }
  }
  for (int64_t i = 0; i < nd; ++i) {
    if (cur[i] != dst[i]) {
      steps.push_back({i, cur[i], dst[i]});
      cur[i] = dst[i];
    }
  }
  cache.emplace(std::move(key), steps);
  return steps;
}

comm::PendingResult redistribute_local(const at::Tensor& local, const DTensorSpec& src,
                                       const DTensorSpec& dst,
                                       const RedistributeLocalOptions& options) {
  const DeviceMesh& mesh = src.mesh();
  TORCH_CHECK(mesh == dst.mesh(), "Cross device mesh comm not supported yet! (from ", mesh, " to ",
              dst.mesh(), ")");
  if (!mesh.contains_this_rank()) return comm::PendingResult({}, local, nullptr, "");
  Placements target(dst.placements().begin(), dst.placements().end());
  if (options.is_backward) {
    // Gradients never become Partial by division: keep replicas, gather shards.
    for (size_t i = 0; i < target.size(); ++i) {
      if (target[i].is_partial() && !src.placements()[i].is_partial()) target[i] = Replicate();
    }
  }
  const auto steps = plan_redistribute(src.placements(), target);
  Placements cur(src.placements().begin(), src.placements().end());
  const auto& coord = *mesh.coordinate();
  at::Tensor t = local;
  comm::PendingResult pending({}, t, nullptr, "");
  for (size_t s = 0; s < steps.size(); ++s) {
    const auto& st = steps[s];
    const bool last = s + 1 == steps.size();
    const bool async = options.async_op && last;
    const int64_t i = st.mesh_dim;
    const int64_t k = mesh.size(i);
    const Placement from = st.src, to = st.dst;
    if (k == 1) {
      // One rank along this dim: its shard is the whole, its partial value the reduced one.
      // A relabel, no collective: a 1-rank mesh (TP=1) costs what plain LibTorch does.
      cur[i] = to;
      continue;
    }
    comm::ProcessGroup& pg = mesh.group(i);
    if (from.is_shard() && to.is_replicate()) {
      pending = shard_to_replicate(t, from.dim(), logical_size(src, cur, i, from.dim()), pg, async);
    } else if (from.is_partial() && to.is_replicate()) {
      pending = partial_to_replicate(t, from, pg, async);
    } else if (from.is_partial() && to.is_shard()) {
      TORCH_CHECK(!from.is_norm_partial(),
                  "dtensor: a pending norm cannot be scattered; "
                  "replicate it first");
      const int64_t d = to.dim();
      const int64_t n = logical_size(src, cur, i, d);
      const int64_t c = full_chunk_size(n, k);
      at::Tensor in = t;
      if (c * k != n) {
        // Pad every chunk (fewer than k chunks, or shorter last ones) to the full chunk size.
        std::vector<at::Tensor> parts;
        for (int64_t r = 0; r < k; ++r) {
          const ShardRange rg = chunk_range(n, k, r);
          parts.push_back(pad_to(t.narrow(d, rg.size == 0 ? n : rg.offset, rg.size), d, c));
        }
        in = at::cat(parts, d);
      }
      pending = comm::reduce_scatter_tensor_async(in, d, from.reduce_op(), pg);
      const int64_t mine = chunk_range(n, k, coord[i]).size;
      if (mine != c)
        pending.then([d, mine](at::Tensor x) { return x.narrow(d, 0, mine).contiguous(); });
      if (!async) pending.wait();
    } else if (from.is_replicate() && to.is_shard()) {
      pending = comm::PendingResult({}, local_chunk(t, to.dim(), k, coord[i]), nullptr, "");
    } else if (from.is_replicate() && to.is_partial()) {
      pending =
          comm::PendingResult({}, replicate_to_partial(t, to, k, options.is_backward), nullptr, "");
    } else if (from.is_shard() && to.is_shard()) {
      // Shard-dim change: gather the old dim, keep our chunk of the new one. (Counted as an
      // all-gather, as PyTorch does on CPU.)
      auto g = shard_to_replicate(t, from.dim(), logical_size(src, cur, i, from.dim()), pg,
                                  /*async=*/false);
      pending = comm::PendingResult({}, local_chunk(g.wait(), to.dim(), k, coord[i]), nullptr, "");
    } else if (from.is_shard() && to.is_partial()) {
      TORCH_CHECK(options.is_backward, "redistribute from ", from.str(), " to ", to.str(),
                  " not supported yet");
      pending = shard_to_replicate(t, from.dim(), logical_size(src, cur, i, from.dim()), pg, async);
    } else if (from.is_partial() && to.is_partial()) {
      // A different reduction (P(avg) meeting P(sum)): reduce to a replica, then split it
      // the target's way.
      at::Tensor r = partial_to_replicate(t, from, pg, /*async=*/false).wait();
      pending =
          comm::PendingResult({}, replicate_to_partial(r, to, k, options.is_backward), nullptr, "");
    }
    cur[i] = to;
    if (!async) t = pending.wait();
  }
  // Gathers and chunks leave their own layout (an all-gather's output is contiguous): the
  // result takes the dim order of the global strides, as every DTensor's local tensor does,
  // so views decided on the global strides stay valid on the shard.
  if (steps.empty()) return pending;
  if (pending.ready()) {
    return comm::PendingResult({}, follow_stride_order(pending.wait(), dst.stride()), nullptr, "");
  }
  std::vector<int64_t> stride(dst.stride().begin(), dst.stride().end());
  pending.then([stride = std::move(stride)](at::Tensor x) {
    return follow_stride_order(std::move(x), stride);
  });
  return pending;
}

at::Tensor follow_stride_order(at::Tensor local, c10::IntArrayRef global_stride) {
  if (local.numel() <= 1 || static_cast<size_t>(local.dim()) != global_stride.size()) {
    return local;
  }
  // A dim the global tensor broadcasts (stride 0, e.g. the gradient of a sum) holds one value
  // along it, and the shard keeps it broadcast: a view the global strides allow (any merge of
  // broadcast dims) must stay valid on the shard after a permute, which a dense copy is not.
  std::vector<int64_t> held(local.sizes().begin(), local.sizes().end());
  for (int64_t d = 0; d < local.dim(); ++d) {
    if (global_stride[d] == 0) held[d] = 1;
  }
  const auto dense = strides_like(held, global_stride);
  for (int64_t d = 0; d < local.dim(); ++d) {
    const int64_t want = global_stride[d] == 0 ? 0 : dense[d];
    if (local.size(d) > 1 && local.stride(d) != want) {
      at::Tensor one = local;
      for (int64_t b = 0; b < local.dim(); ++b) {
        if (global_stride[b] == 0) one = one.narrow(b, 0, 1);
      }
      at::Tensor laid = at::empty_strided(held, dense, local.options());
      laid.copy_(one);
      return laid.expand(local.sizes());
    }
  }
  return local;
}

}  // namespace dtensor
