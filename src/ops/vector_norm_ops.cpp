// Vector norms (gradient clipping): a shard of a reduced dim leaves a pending p-norm
// (docs/ARCHITECTURE.md, "Placements and shard math"); norms of pending norms of the same p stay
// pending.
#include "dtensor/ops/layout_invariant.h"
#include "dtensor/ops/rule_utils.h"
#include "layout_invariant_rules.h"
#include "reduction_layout.h"

namespace dtensor::ops {
namespace {

// linalg_vector_norm(self, ord, dim, keepdim, dtype) / norm.ScalarOpt_dim(self, p, dim, keepdim)
Decision vector_norm(const OpCall& call, double ord, std::optional<std::vector<int64_t>> dims,
                     bool keepdim) {
  const DTensorSpec& in = call.input(0);
  const int64_t nd = in.ndim();
  std::vector<bool> reduced(nd, !dims || dims->empty());
  if (dims) {
    for (auto d : *dims) {
      if (nd > 0) reduced[wrap_dim(d, nd)] = true;  // a 0-d tensor's dim 0 or -1 is itself
    }
  }
  Placements tgt, out;
  for (size_t i = 0; i < in.placements().size(); ++i) {
    const Placement& p = in.placements()[i];
    // an inf-norm has no identity for an empty shard; sums of p-th powers do (0)
    if (p.is_shard() && reduced[p.dim()] && ord != 0.0 &&
        keepable_shards(in, p.dim(), {.nonempty = std::isinf(ord)})[i]) {
      tgt.push_back(p);
      out.push_back(Placement::norm_partial(ord));
    } else if (p.is_shard() && !reduced[p.dim()]) {
      int64_t shift = 0;
      if (!keepdim) {
        for (int64_t d = 0; d < p.dim(); ++d) shift += reduced[d] ? 1 : 0;
      }
      tgt.push_back(p);
      out.push_back(Shard(p.dim() - shift));
    } else if (p.is_norm_partial() && p.norm_p() == ord) {
      tgt.push_back(p);  // the norm of pending p-norms is the pending p-norm of everything
      out.push_back(p);
    } else {
      tgt.push_back(Replicate());
      out.push_back(Replicate());
    }
  }
  return all_outputs(call, {tgt}, out);
}

double scalar_or(const c10::IValue& v, double dflt) {
  return v.isNone() ? dflt : v.toScalar().toDouble();
}

}  // namespace

DTENSOR_RULES(vector_norm) {
  using dispatch::register_rule;
  const dispatch::Rule linalg = [](const OpCall& c) {
    return vector_norm(c, scalar_or(c.arg(1), 2.0), c.opt_int_list_arg(2), c.bool_arg(3));
  };
  const dispatch::Rule whole = [](const OpCall& c) {
    return vector_norm(c, scalar_or(c.arg(1), 2.0), {}, false);
  };
  const dispatch::Rule dims = [](const OpCall& c) {
    return vector_norm(c, scalar_or(c.arg(1), 2.0), c.opt_int_list_arg(2), c.bool_arg(3));
  };
  register_rule("aten::linalg_vector_norm", linalg, /*static_args=*/{1});
  register_rule({"aten::norm.Scalar", "aten::norm.ScalarOpt_dtype"}, whole, {1});
  register_rule({"aten::norm.ScalarOpt_dim", "aten::norm.ScalarOpt_dim_dtype"}, dims, {1});
  // LayoutInvariantMode: a norm over a sharded dim sums its p-th powers in the canonical order.
  using dispatch::register_context_rule;
  register_context_rule("aten::linalg_vector_norm", kLayoutInvariantBit,
                        detail::canonical_reduction_rule(linalg, true));
  register_context_rule({"aten::norm.Scalar", "aten::norm.ScalarOpt_dtype"}, kLayoutInvariantBit,
                        detail::canonical_reduction_rule(whole, true));
  register_context_rule({"aten::norm.ScalarOpt_dim", "aten::norm.ScalarOpt_dim_dtype"},
                        kLayoutInvariantBit, detail::canonical_reduction_rule(dims, true));
}

}  // namespace dtensor::ops
