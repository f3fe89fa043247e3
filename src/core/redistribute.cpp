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

namespace {

// One step of a plan: a mesh dim of more than one rank changes placement. `current` holds every
// mesh dim's placement before this step.
struct MeshDimStep {
  const DTensorSpec& spec;
  c10::ArrayRef<Placement> current;
  int64_t mesh_dim;
  comm::ProcessGroup& pg;
  int64_t k;      // ranks along the mesh dim
  int64_t coord;  // this rank's index along it
  bool async;     // leave the collective in flight
  bool is_backward;
  // Size of tensor dim `d` as this mesh dim sees it.
  int64_t logical_size(int64_t d) const {
    return dtensor::logical_size(spec, current, mesh_dim, d);
  }
  // `p`, waited for unless the step is asynchronous.
  comm::PendingResult settle(comm::PendingResult p) const {
    if (!async) p.wait();
    return p;
  }
};

comm::PendingResult done(at::Tensor t) {
  return comm::PendingResult({}, std::move(t), nullptr, "");
}

// The transitions, one per (from, to) kind, after PyTorch's placement methods. Each takes the
// local tensor laid out as `from` and returns it laid out as `to` (pending when the step is
// asynchronous).

// S(d) -> R (Shard._to_replicate_tensor): pad to the full chunk, all-gather, trim.
comm::PendingResult shard_to_replicate(const at::Tensor& t, const Placement& from,
                                       const Placement& /*to*/, const MeshDimStep& s) {
  const int64_t d = from.dim(), n = s.logical_size(d);
  const int64_t c = full_chunk_size(n, s.k);
  auto p = comm::all_gather_into_tensor_async(pad_to(t, d, c), d, s.pg);
  if (c * s.k != n) p.then([d, n](at::Tensor x) { return x.narrow(d, 0, n).contiguous(); });
  return s.settle(std::move(p));
}

// S(d) -> S(d') (Shard._to_new_shard_dim): gather d, keep this rank's chunk of d'. Counted as an
// all-gather, as PyTorch does on CPU.
comm::PendingResult shard_to_shard(const at::Tensor& t, const Placement& from, const Placement& to,
                                   const MeshDimStep& s) {
  MeshDimStep gather = s;
  gather.async = false;
  at::Tensor whole = shard_to_replicate(t, from, Replicate(), gather).wait();
  return done(local_chunk(whole, to.dim(), s.k, s.coord));
}

// S -> P: only a gradient (backward) may take it, where it is S -> R.
comm::PendingResult shard_to_partial(const at::Tensor& t, const Placement& from,
                                     const Placement& to, const MeshDimStep& s) {
  TORCH_CHECK(s.is_backward, "redistribute from ", from.str(), " to ", to.str(),
              " not supported yet");
  return shard_to_replicate(t, from, Replicate(), s);
}

// R -> S(d) (Shard._replicate_to_shard): this rank's chunk, cloned; no communication.
comm::PendingResult replicate_to_shard(const at::Tensor& t, const Placement& /*from*/,
                                       const Placement& to, const MeshDimStep& s) {
  return done(local_chunk(t, to.dim(), s.k, s.coord));
}

// R -> P (Partial._partition_value): the local value that reduces to `t` over the k ranks; no
// communication. Gradients (backward) keep the replica.
comm::PendingResult replicate_to_partial(const at::Tensor& t, const Placement& /*from*/,
                                         const Placement& to, const MeshDimStep& s) {
  if (s.is_backward) return done(t);
  switch (to.reduce_op()) {
    case ReduceOp::Sum:  // summing k copies (of p-th powers for a norm) gives the value
      return done(to.is_norm_partial() ? t / std::pow(static_cast<double>(s.k), 1.0 / to.norm_p())
                                       : t / s.k);
    case ReduceOp::Avg:
    case ReduceOp::Max:
    case ReduceOp::Min:
      return done(t);  // reducing identical copies is the identity
    case ReduceOp::Product:
      break;
  }
  TORCH_CHECK(false, "dtensor: redistributing to ", to.str(),
              " is not supported (only to Partial(sum|avg|max|min)); replicate instead");
}

// P -> R (Partial._reduce_value): all-reduce (a pending p-norm sums the p-th powers, then takes
// the root).
comm::PendingResult partial_to_replicate(const at::Tensor& t, const Placement& from,
                                         const Placement& /*to*/, const MeshDimStep& s) {
  const double p = from.norm_p();
  if (p != 0.0 && std::isfinite(p)) {
    auto pending = comm::all_reduce_async(t.abs().pow(p), ReduceOp::Sum, s.pg);
    pending.then([p](at::Tensor x) { return x.pow(1.0 / p); });
    return s.settle(std::move(pending));
  }
  return s.settle(comm::all_reduce_async(t, from.reduce_op(), s.pg));
}

// P -> S(d) (Partial._reduce_shard_value): pad every chunk to the full chunk size if uneven,
// reduce-scatter, trim this rank's shard.
comm::PendingResult partial_to_shard(const at::Tensor& t, const Placement& from,
                                     const Placement& to, const MeshDimStep& s) {
  TORCH_CHECK(!from.is_norm_partial(),
              "dtensor: a pending norm cannot be scattered; "
              "replicate it first");
  const int64_t d = to.dim(), n = s.logical_size(d), k = s.k;
  const int64_t c = full_chunk_size(n, k);
  at::Tensor in = t;
  if (c * k != n) {
    // Fewer than k chunks, or shorter last ones.
    std::vector<at::Tensor> parts;
    for (int64_t r = 0; r < k; ++r) {
      const ShardRange rg = chunk_range(n, k, r);
      parts.push_back(pad_to(t.narrow(d, rg.size == 0 ? n : rg.offset, rg.size), d, c));
    }
    in = at::cat(parts, d);
  }
  auto pending = comm::reduce_scatter_tensor_async(in, d, from.reduce_op(), s.pg);
  const int64_t mine = chunk_range(n, k, s.coord).size;
  if (mine != c)
    pending.then([d, mine](at::Tensor x) { return x.narrow(d, 0, mine).contiguous(); });
  return s.settle(std::move(pending));
}

// P -> P' (a different reduction, as P(avg) meeting P(sum)): reduce to a replica, then split it
// the target's way.
comm::PendingResult partial_to_partial(const at::Tensor& t, const Placement& from,
                                       const Placement& to, const MeshDimStep& s) {
  MeshDimStep reduce = s;
  reduce.async = false;
  at::Tensor whole = partial_to_replicate(t, from, Replicate(), reduce).wait();
  return replicate_to_partial(whole, Replicate(), to, s);
}

using Transition = comm::PendingResult (*)(const at::Tensor&, const Placement&, const Placement&,
                                           const MeshDimStep&);

// The transition from `from`'s kind to `to`'s. R -> R never is a step.
Transition transition(const Placement& from, const Placement& to) {
  using T = Placement::Type;
  // Indexed [from][to] in Placement::Type's order: Replicate, Shard, Partial.
  static constexpr Transition kTable[3][3] = {
      {nullptr, replicate_to_shard, replicate_to_partial},
      {shard_to_replicate, shard_to_shard, shard_to_partial},
      {partial_to_replicate, partial_to_shard, partial_to_partial},
  };
  static_assert(static_cast<int>(T::Replicate) == 0 && static_cast<int>(T::Shard) == 1 &&
                static_cast<int>(T::Partial) == 2);
  return kTable[static_cast<int>(from.type())][static_cast<int>(to.type())];
}

}  // namespace

comm::PendingResult redistribute_local(const at::Tensor& local, const DTensorSpec& src,
                                       const DTensorSpec& dst,
                                       const RedistributeLocalOptions& options) {
  const DeviceMesh& mesh = src.mesh();
  TORCH_CHECK(mesh == dst.mesh(), "Cross device mesh comm not supported yet! (from ", mesh, " to ",
              dst.mesh(), ")");
  if (!mesh.contains_this_rank()) return done(local);
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
  comm::PendingResult pending = done(t);
  for (size_t i = 0; i < steps.size(); ++i) {
    const RedistributeStep& st = steps[i];
    const int64_t m = st.mesh_dim;
    if (mesh.size(m) > 1) {
      const bool async = options.async_op && i + 1 == steps.size();
      const MeshDimStep step{src,          cur,      m,     mesh.group(m),
                             mesh.size(m), coord[m], async, options.is_backward};
      pending = transition(st.src, st.dst)(t, st.src, st.dst, step);
      if (!async) t = pending.wait();
    }
    // Over one rank a step is a relabel: its shard is the whole, its partial value the reduced
    // one. No collective, so a 1-rank mesh (TP=1) costs what plain LibTorch does.
    cur[m] = st.dst;
  }
  // Gathers and chunks leave their own layout (an all-gather's output is contiguous): the
  // result takes the dim order of the global strides, as every DTensor's local tensor does,
  // so views decided on the global strides stay valid on the shard.
  if (steps.empty()) return pending;
  if (pending.ready()) return done(follow_stride_order(pending.wait(), dst.stride()));
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
