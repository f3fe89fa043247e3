// Reductions (docs/ARCHITECTURE.md, "Reductions, norms, softmax and losses"): a Shard on a
// reduced dim becomes Partial(op); Partial inputs pass through linear reductions. A reduced dim
// whose shards would make the combined result wrong (uneven shards for a mean, empty shards for
// max/min) is replicated first. Reductions that return indices (max.dim, argmax) replicate the
// reduced dim so the indices are global; their backward scatters the gradient back along it.
#include "dtensor/ops/layout_invariant.h"
#include "dtensor/ops/rule_utils.h"
#include "layout_invariant_rules.h"
#include "reduction_layout.h"
#include "strategy/iteration_space.h"

namespace dtensor::ops {
namespace {

struct ReductionKind {
  ReduceOp op;
  bool linear;  // Partial(sum) inputs may pass through
  ShardNeeds needs;
};

std::vector<bool> reduced_dims(int64_t nd, const std::optional<std::vector<int64_t>>& dims) {
  std::vector<bool> reduced(nd, !dims || dims->empty());
  if (dims && nd > 0) {  // a 0-d tensor's dim 0 or -1 is itself: nothing to mark
    for (auto d : *dims) reduced[wrap_dim(d, nd)] = true;
  }
  return reduced;
}

// Shard(d) of a kept dim, renumbered for the output (reduced dims before it disappear
// without keepdim).
Placement kept_shard(int64_t d, const std::vector<bool>& reduced, bool keepdim) {
  int64_t shift = 0;
  if (!keepdim) {
    for (int64_t e = 0; e < d; ++e) shift += reduced[e] ? 1 : 0;
  }
  return Shard(d - shift);
}

// dims = nullopt or empty list: reduce everything.
Decision reduce(const OpCall& call, ReductionKind kind, std::optional<std::vector<int64_t>> dims,
                bool keepdim) {
  const DTensorSpec& in = call.input(0);
  const int64_t nd = in.ndim();
  const std::vector<bool> reduced = reduced_dims(nd, dims);
  Placements tgt, out;
  for (size_t i = 0; i < in.placements().size(); ++i) {
    const Placement& p = in.placements()[i];
    if (p.is_shard() && nd > 0 && reduced[p.dim()]) {
      if (keepable_shards(in, p.dim(), kind.needs)[i]) {
        tgt.push_back(p);
        out.push_back(Partial(kind.op));
      } else {
        tgt.push_back(Replicate());
        out.push_back(Replicate());
      }
    } else if (p.is_shard()) {
      tgt.push_back(p);
      out.push_back(kept_shard(p.dim(), reduced, keepdim));
    } else if (p.is_partial()) {
      const bool pass = kind.linear && !p.is_norm_partial() &&
                        (p.reduce_op() == ReduceOp::Sum || p.reduce_op() == ReduceOp::Avg);
      tgt.push_back(pass ? p : Replicate());
      out.push_back(pass ? p : Replicate());
    } else {
      tgt.push_back(p);
      out.push_back(p);
    }
  }
  std::vector<Placements> inputs{tgt};
  for (size_t j = 1; j < call.num_inputs(); ++j) inputs.push_back(replicate_all(call.mesh_ndim()));
  Decision d = all_outputs(call, std::move(inputs), out);
  // Some full reductions (max(), min()) have no meta kernel: give the output metadata here.
  std::vector<int64_t> shape;
  for (int64_t i = 0; i < nd; ++i) {
    if (!reduced[i]) {
      shape.push_back(in.shape()[i]);
    } else if (keepdim) {
      shape.push_back(1);
    }
  }
  const at::ScalarType dtype = proxy_result_dtype(call);
  for (auto& o : d.outputs) {
    if (o)
      d.output_meta.push_back(TensorMeta{shape, default_strides(shape), dtype});
    else
      d.output_meta.push_back(std::nullopt);
  }
  return d;
}

// A reduction that needs each reduced dim whole (values with their global indices, a
// variance): the reduced dims are gathered, shards of other dims stay, pending values are
// reduced first. dims = nullopt or empty: every dim.
Decision reduce_whole_dims(const OpCall& call, const std::optional<std::vector<int64_t>>& dims,
                           bool keepdim) {
  const DTensorSpec& in = call.input(0);
  const std::vector<bool> reduced = reduced_dims(in.ndim(), dims);
  Placements tgt, out;
  for (const Placement& p : in.placements()) {
    if (p.is_shard() && !reduced[p.dim()]) {
      tgt.push_back(p);
      out.push_back(kept_shard(p.dim(), reduced, keepdim));
    } else {
      tgt.push_back(Replicate());
      out.push_back(Replicate());
    }
  }
  return all_outputs(call, {tgt}, out);
}

// The same for var and std (and var_mean, std_mean), which have no meta kernel: every return
// has the reduced shape.
Decision variance(const OpCall& call) {
  // var(self, unbiased) reduces every dim; the other overloads take (self, dim, ..., keepdim).
  const bool all = call.num_args() < 4;
  const std::optional<std::vector<int64_t>> dims = all ? std::nullopt : call.opt_int_list_arg(1);
  const bool keepdim = !all && call.bool_arg(3);
  Decision d = reduce_whole_dims(call, dims, keepdim);
  const DTensorSpec& in = call.input(0);
  const std::vector<bool> reduced = reduced_dims(in.ndim(), dims);
  std::vector<int64_t> shape;
  for (int64_t i = 0; i < in.ndim(); ++i) {
    if (!reduced[i] || keepdim) shape.push_back(reduced[i] ? 1 : in.shape()[i]);
  }
  for (size_t r = 0; r < d.outputs.size(); ++r) {
    d.output_meta.push_back(contiguous_meta(shape, proxy_result_dtype(call, r)));
  }
  return d;
}

// max.dim / min.dim / argmax / argmin: values and indices along `dim` (nullopt: over the
// flattened tensor), the indices global.
Decision reduce_with_indices(const OpCall& call, std::optional<int64_t> dim, bool keepdim) {
  if (!dim) return reduce_whole_dims(call, std::nullopt, keepdim);
  return reduce_whole_dims(call, std::vector<int64_t>{*dim}, keepdim);
}

// histc(self, bins, min, max): with a range given (min < max) each rank counts its shard into
// the same bins, so shards become a pending sum; with min = max = 0 the range is the data's
// own min and max, which a shard does not know: replicated (PyTorch's rule).
Decision histc(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const bool ranged = call.arg(2).toScalar().toDouble() != call.arg(3).toScalar().toDouble();
  Placements tgt, out;
  for (const Placement& p : in.placements()) {
    const bool keep = ranged && p.is_shard();
    tgt.push_back(keep ? p : Replicate());
    out.push_back(keep ? Placement(Partial()) : Placement(Replicate()));
  }
  Decision d = all_outputs(call, {tgt}, out);
  d.output_meta = {contiguous_meta({call.int_arg(1)}, in.dtype())};  // no meta kernel
  return d;
}

// sort / topk / cumsum along `dim`: that dim is gathered (every output element depends on
// the whole of it, and indices must be global); shards of other dims stay.
Decision along_dim(const OpCall& call, int64_t dim) {
  const DTensorSpec& in = call.input(0);
  const int64_t d = wrap_dim(dim, in.ndim());
  Placements tgt;
  for (const Placement& p : in.placements()) {
    tgt.push_back(p.is_shard() && p.dim() != d ? p : Replicate());
  }
  return all_outputs(call, {tgt}, tgt);
}

// value_selecting_reduction_backward(grad, dim, indices, sizes, keepdim), the backward of
// max/min.dim, sort and topk: zeros of `sizes` with grad scattered to `indices` along `dim`.
// Indices are global positions along `dim`, so that dim stays whole; other dims of grad and
// indices shard together, and a Partial grad passes (the zeros are the same on every rank).
Decision value_selecting_backward(const OpCall& call) {
  using namespace iteration;
  const auto sizes = call.int_list_arg(3);
  const int64_t nd = static_cast<int64_t>(sizes.size());
  const int64_t dim = wrap_dim(call.int_arg(1), nd);
  const bool kept = call.bool_arg(4) || call.input(0).ndim() == nd;
  Space s = same_shape_space(call, sizes, {dim});
  s.lin = Lin::Select;
  for (size_t input : {size_t{0}, size_t{1}}) {
    Operand& o = s.operand(input, /*linear=*/input == 0);
    for (int64_t L = 0; L < nd; ++L) {
      if (L != dim) o.dims[L] = kept || L < dim ? L : L - 1;
    }
  }
  Decision d = decide(call, s);
  d.local_args.push_back({3, c10::IValue(local_shape_of(call.mesh(), sizes, *d.outputs[0]))});
  return d;
}

std::optional<std::vector<int64_t>> any_all_dims(const OpCall& c) {
  if (c.num_args() > 1 && c.arg(1).isInt()) return std::vector<int64_t>{c.arg(1).toInt()};
  if (c.num_args() > 1 && c.arg(1).isIntList()) return c.arg(1).toIntVector();
  return std::nullopt;
}

constexpr ShardNeeds kAnySize{};
constexpr ShardNeeds kEven{.even = true};
constexpr ShardNeeds kNonEmpty{.nonempty = true};

}  // namespace

DTENSOR_RULES(reduction) {
  using dispatch::register_rule;
  // sum(self, dtype) / sum.dim_IntList(self, dim, keepdim, dtype)
  const dispatch::Rule sum = [](const OpCall& c) {
    return reduce(c, {ReduceOp::Sum, true, kAnySize}, {}, false);
  };
  const dispatch::Rule sum_dims = [](const OpCall& c) {
    return reduce(c, {ReduceOp::Sum, true, kAnySize}, c.opt_int_list_arg(1), c.bool_arg(2));
  };
  register_rule("aten::sum", sum);
  register_rule("aten::sum.dim_IntList", sum_dims);
  // LayoutInvariantMode: a sum over a sharded dim is taken in the canonical order.
  dispatch::register_context_rule("aten::sum", kLayoutInvariantBit,
                                  detail::canonical_reduction_rule(sum, false));
  dispatch::register_context_rule("aten::sum.dim_IntList", kLayoutInvariantBit,
                                  detail::canonical_reduction_rule(sum_dims, false));
  register_rule("aten::mean", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Avg, true, kEven}, {}, false);
  });
  register_rule("aten::mean.dim", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Avg, true, kEven}, c.opt_int_list_arg(1), c.bool_arg(2));
  });
  register_rule({"aten::amax"}, [](const OpCall& c) {
    return reduce(c, {ReduceOp::Max, false, kNonEmpty}, c.opt_int_list_arg(1), c.bool_arg(2));
  });
  register_rule({"aten::amin"}, [](const OpCall& c) {
    return reduce(c, {ReduceOp::Min, false, kNonEmpty}, c.opt_int_list_arg(1), c.bool_arg(2));
  });
  register_rule("aten::max", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Max, false, kNonEmpty}, {}, false);
  });
  register_rule("aten::min", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Min, false, kNonEmpty}, {}, false);
  });
  register_rule("aten::prod", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Product, false, kAnySize}, {}, false);
  });
  // prod.dim_int(self, dim, keepdim, dtype): an empty shard's product is 1, the identity.
  register_rule("aten::prod.dim_int", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Product, false, kAnySize}, std::vector<int64_t>{c.int_arg(1)},
                  c.bool_arg(2));
  });
  // any/all of an empty shard is false/true, the identity of the combining max/min
  register_rule({"aten::any", "aten::any.dim", "aten::any.dims"}, [](const OpCall& c) {
    return reduce(c, {ReduceOp::Max, false, kAnySize}, any_all_dims(c),
                  c.num_args() > 2 && c.bool_arg(2));
  });
  register_rule({"aten::all", "aten::all.dim", "aten::all.dims"}, [](const OpCall& c) {
    return reduce(c, {ReduceOp::Min, false, kAnySize}, any_all_dims(c),
                  c.num_args() > 2 && c.bool_arg(2));
  });
  // max.dim(self, dim, keepdim) -> (values, indices); argmax(self, dim=None, keepdim)
  register_rule({"aten::max.dim", "aten::min.dim"}, [](const OpCall& c) {
    return reduce_with_indices(c, c.int_arg(1), c.bool_arg(2));
  });
  register_rule({"aten::argmax", "aten::argmin"}, [](const OpCall& c) {
    std::optional<int64_t> dim;
    if (!c.arg(1).isNone()) dim = c.arg(1).toInt();
    return reduce_with_indices(c, dim, c.bool_arg(2));
  });
  // sort(self, dim, descending); sort.stable(self, *, stable, dim, descending);
  // topk(self, k, dim, largest, sorted); cumsum/cumprod(self, dim, dtype)
  register_rule("aten::sort", [](const OpCall& c) { return along_dim(c, c.int_arg(1, -1)); });
  register_rule("aten::sort.stable",
                [](const OpCall& c) { return along_dim(c, c.int_arg(2, -1)); });
  register_rule("aten::topk", [](const OpCall& c) { return along_dim(c, c.int_arg(2, -1)); });
  register_rule("aten::value_selecting_reduction_backward", value_selecting_backward);
  register_rule({"aten::cumsum", "aten::cumprod"},
                [](const OpCall& c) { return along_dim(c, c.int_arg(1)); });
  // var/std(self, dim?, correction or unbiased, keepdim) and var_mean/std_mean: not linear in
  // the shards (PyTorch's rule), so the reduced dims are gathered.
  register_rule({"aten::var.correction", "aten::var.dim", "aten::std.correction", "aten::std.dim",
                 "aten::var_mean.correction", "aten::std_mean.correction"},
                variance);
  register_rule({"aten::var", "aten::std"}, variance);
  register_rule("aten::histc", histc, /*static_args=*/{2, 3});
}

}  // namespace dtensor::ops
