// Reductions: a Shard on a reduced dim becomes Partial(op); Partial inputs pass through linear
// reductions; reducing an unevenly sharded dim by mean replicates it first.
#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

struct ReductionKind {
  ReduceOp op;
  bool linear;  // Partial(sum) inputs may pass through
};

// dims = nullopt or empty list: reduce everything.
Decision reduce(const OpCall& call, ReductionKind kind, std::optional<std::vector<int64_t>> dims,
                bool keepdim) {
  const DTensorSpec& in = call.input(0);
  const int64_t nd = in.ndim();
  std::vector<bool> reduced(nd, false);
  if (!dims || dims->empty()) {
    std::fill(reduced.begin(), reduced.end(), true);
  } else {
    for (auto d : *dims) reduced[wrap_dim(d, nd)] = true;
  }
  Placements tgt, out;
  for (size_t i = 0; i < in.placements().size(); ++i) {
    const Placement& p = in.placements()[i];
    const int64_t k = call.mesh().size(static_cast<int64_t>(i));
    if (p.is_shard() && nd > 0 && reduced[p.dim()]) {
      const bool uneven = in.shape()[p.dim()] % k != 0;
      const bool empty_shard = chunk_range(in.shape()[p.dim()], k, k - 1).size == 0;
      if ((kind.op == ReduceOp::Avg && uneven) || (empty_shard && kind.op != ReduceOp::Sum)) {
        // A mean of uneven shards would be biased; max/min/prod of an empty shard is undefined.
        tgt.push_back(Replicate());
        out.push_back(Replicate());
      } else {
        tgt.push_back(p);
        out.push_back(Partial(kind.op));
      }
    } else if (p.is_shard()) {
      int64_t shift = 0;
      if (!keepdim) {
        for (int64_t d = 0; d < p.dim(); ++d) shift += reduced[d] ? 1 : 0;
      }
      tgt.push_back(p);
      out.push_back(Shard(p.dim() - shift));
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

}  // namespace

DTENSOR_RULES(reduction) {
  using dispatch::register_rule;
  // sum(self, dtype) / sum.dim_IntList(self, dim, keepdim, dtype)
  register_rule("aten::sum", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Sum, true}, {}, false);
  });
  register_rule("aten::sum.dim_IntList", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Sum, true}, c.opt_int_list_arg(1), c.bool_arg(2));
  });
  register_rule("aten::mean", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Avg, true}, {}, false);
  });
  register_rule("aten::mean.dim", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Avg, true}, c.opt_int_list_arg(1), c.bool_arg(2));
  });
  register_rule({"aten::amax"}, [](const OpCall& c) {
    return reduce(c, {ReduceOp::Max, false}, c.opt_int_list_arg(1), c.bool_arg(2));
  });
  register_rule({"aten::amin"}, [](const OpCall& c) {
    return reduce(c, {ReduceOp::Min, false}, c.opt_int_list_arg(1), c.bool_arg(2));
  });
  register_rule("aten::max", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Max, false}, {}, false);
  });
  register_rule("aten::min", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Min, false}, {}, false);
  });
  register_rule("aten::prod", [](const OpCall& c) {
    return reduce(c, {ReduceOp::Product, false}, {}, false);
  });
  register_rule({"aten::any", "aten::any.dim", "aten::any.dims"}, [](const OpCall& c) {
    std::optional<std::vector<int64_t>> dims;
    if (c.num_args() > 1 && c.arg(1).isInt()) dims = std::vector<int64_t>{c.arg(1).toInt()};
    if (c.num_args() > 1 && c.arg(1).isIntList()) dims = c.arg(1).toIntVector();
    return reduce(c, {ReduceOp::Max, false}, dims, c.num_args() > 2 && c.bool_arg(2));
  });
  register_rule({"aten::all", "aten::all.dim", "aten::all.dims"}, [](const OpCall& c) {
    std::optional<std::vector<int64_t>> dims;
    if (c.num_args() > 1 && c.arg(1).isInt()) dims = std::vector<int64_t>{c.arg(1).toInt()};
    if (c.num_args() > 1 && c.arg(1).isIntList()) dims = c.arg(1).toIntVector();
    return reduce(c, {ReduceOp::Min, false}, dims, c.num_args() > 2 && c.bool_arg(2));
  });
}

}  // namespace dtensor::ops
