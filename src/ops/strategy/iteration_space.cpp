#include "iteration_space.h"

#include <algorithm>

namespace dtensor::ops::iteration {
namespace {

bool partial_passes(Lin lin, const Placement& p) {
  if (lin == Lin::Select) return true;
  return lin == Lin::Sum && !p.is_norm_partial() &&
         (p.reduce_op() == ReduceOp::Sum || p.reduce_op() == ReduceOp::Avg);
}

// Whether logical dim L can be sharded: every operand running over it has its full size
// (or broadcasts it), and at least one really has it.
bool can_shard(const OpCall& call, const Space& s, size_t L) {
  if (!s.shardable[L]) return false;
  if (s.out[L] < 0 && s.lin != Lin::Sum) return false;
  bool carried = false;
  for (const auto& o : s.operands) {
    const int64_t d = o.dims[L];
    if (d < 0) continue;
    const int64_t sz = call.input(o.input).shape()[d];
    if (sz == s.size[L]) {
      carried = true;
    } else if (!(o.broadcast && sz == 1)) {
      return false;
    }
  }
  return carried;
}

struct Choice {
  enum Kind { R, S, P } kind = R;
  size_t dim = 0;     // logical dim for S
  Placement partial;  // for P
};

// One mesh dim's placements for choice `c`: `nret` outputs, then every input.
DimStrategy dim_strategy(const OpCall& call, const Space& s, const Choice& c, size_t nret) {
  DimStrategy d(nret + call.num_inputs(), Replicate());
  Placement out = Replicate();
  if (c.kind == Choice::P) {
    out = c.partial;
    for (const auto& o : s.operands) {
      if (o.linear) d[nret + o.input] = c.partial;
    }
  } else if (c.kind == Choice::S) {
    const size_t L = c.dim;
    const bool summed = s.out[L] < 0;
    out = summed ? Partial() : Shard(s.out[L]);
    for (const auto& o : s.operands) {
      const int64_t dim = o.dims[L];
      if (dim >= 0 && call.input(o.input).shape()[dim] == s.size[L]) {
        d[nret + o.input] = Shard(dim);
      } else if (summed && dim == kAbsent && o.linear) {
        d[nret + o.input] = Partial();  // counted once over the ranks of this mesh dim
      }
    }
  }
  for (size_t r = 0; r < nret; ++r) d[r] = out;
  return d;
}

}  // namespace

Decision decide(const OpCall& call, const Space& s) {
  const int64_t m = call.mesh_ndim();
  const size_t nin = call.num_inputs();
  std::vector<std::vector<Choice>> options(m);
  for (int64_t i = 0; i < m; ++i) {
    options[i].push_back(Choice{});
    for (size_t L = 0; L < s.size.size(); ++L) {
      if (can_shard(call, s, L)) options[i].push_back(Choice{Choice::S, L, {}});
    }
    if (s.lin == Lin::None) continue;
    // A Partial carried by some linear operand, if all linear operands can hold it: the
    // others are Replicate (turned into that Partial) or already hold the same one.
    for (const auto& o : s.operands) {
      const Placement& p = call.input(o.input).placements()[i];
      if (!o.linear || !p.is_partial() || !partial_passes(s.lin, p)) continue;
      bool ok = true, seen = false;
      for (const auto& c : options[i]) seen |= c.kind == Choice::P && c.partial == p;
      for (const auto& q : s.operands) {
        if (!q.linear) continue;
        const auto& in = call.input(q.input);
        const Placement& qp = in.placements()[i];
        // Turning a replica into a Partial divides it: only exact for floating values.
        ok &= qp == p || (qp.is_replicate() &&
                          (c10::isFloatingType(in.dtype()) || c10::isComplexType(in.dtype())));
      }
      if (ok && !seen) options[i].push_back(Choice{Choice::P, 0, p});
    }
  }
  const auto nret = static_cast<size_t>(call.num_returns());
  std::vector<std::vector<DimStrategy>> choices(m);
  for (int64_t i = 0; i < m; ++i) {
    for (const Choice& c : options[i]) choices[i].push_back(dim_strategy(call, s, c, nret));
  }
  // An input written in place keeps its placements.
  StrategyFilter keeps_inplace;
  if (s.inplace >= 0) {
    keeps_inplace = [&](const Strategy& st) {
      const auto& cur = call.input(s.inplace).placements();
      return std::equal(cur.begin(), cur.end(), st.inputs[s.inplace].begin(),
                        st.inputs[s.inplace].end());
    };
  }
  // Uneven and empty shards are fine here: the space only shards dims all operands carry.
  std::vector<Strategy> candidates =
      expand_to_mesh(call, choices, nret, keeps_inplace, /*drop_unshardable=*/false);
  for (auto& st : candidates) {
    for (size_t j = 0; j < nin; ++j) {
      if (s.as_is[j]) st.inputs[j].clear();
    }
  }
  TORCH_CHECK(!candidates.empty(), call.name(), " writes in place into a DTensor with placements ",
              to_string(call.input(s.inplace).placements()), " that it cannot keep (a sharded ",
              "indexed/scattered dim, or a Partial the op is not linear in); redistribute it "
              "first or use the out-of-place op");
  Decision d = dispatch::choose(call, candidates);
  // Several of these ops (roll, flip, index_select, ...) have no C++ meta kernel: the space
  // knows the output shape.
  const auto& op = call.op();
  const bool has_meta =
      op.hasKernelForDispatchKey(c10::DispatchKey::Meta) ||
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
  const auto& rets = call.schema().returns();
  if (!has_meta && rets.size() == 1 && rets[0].type()->kind() == c10::TypeKind::TensorType) {
    std::vector<int64_t> shape;
    for (size_t L = 0; L < s.size.size(); ++L) {
      if (s.out[L] < 0) continue;
      if (static_cast<int64_t>(shape.size()) <= s.out[L]) shape.resize(s.out[L] + 1, 1);
      shape[s.out[L]] = s.size[L];
    }
    if (s.inplace >= 0) {
      d.output_meta = {call.input(s.inplace).meta()};
    } else {
      d.output_meta = {TensorMeta{shape, default_strides(shape), call.input(0).dtype()}};
    }
  }
  return d;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

Operand& identity_operand(Space& s, size_t input, int64_t ndim, bool linear,
                          std::initializer_list<int64_t> skip) {
  Operand& o = s.operand(input, linear);
  for (int64_t d = 0; d < ndim; ++d) {
    if (std::find(skip.begin(), skip.end(), d) == skip.end()) o.dims[d] = d;
  }
  return o;
}

Space same_shape_space(const OpCall& call, c10::IntArrayRef shape,
                       const std::vector<int64_t>& fixed) {
  Space s(call.num_inputs());
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    s.add_dim(shape[d], d, std::find(fixed.begin(), fixed.end(), d) == fixed.end());
  }
  return s;
}

Space dropping_dim_space(const OpCall& call, const DTensorSpec& in, int64_t dim) {
  Space s(call.num_inputs());
  for (int64_t L = 0; L < in.ndim(); ++L) {
    s.add_dim(in.shape()[L], L < dim ? L : (L == dim ? -1 : L - 1), L != dim);
  }
  s.lin = Lin::Select;
  identity_operand(s, 0, in.ndim(), true);
  return s;
}

}  // namespace dtensor::ops::iteration
