// Tensor-manipulation and indexing ops: cat/stack/split, slicing, select, index/gather/scatter,
// repeat/roll/flip, triangles, padding, complex views, equal.
//
// Most rules are written as an iteration space, einsum-style: every logical dim says which dim
// of each operand it runs over and which output dim it becomes (or that it is summed over).
// A mesh dim may then shard any logical dim whose operands agree on its size, carry a Partial
// through operands the op is linear in, or replicate; candidates are compared by the cost model.
#include <ATen/ops/equal.h>
#include <ATen/ops/scalar_tensor.h>

#include "dtensor/comm/collectives.h"
#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

// How a Partial may pass through the op.
enum class Lin {
  None,    // non-linear: Partial inputs are reduced first
  Select,  // the op only moves or drops elements: any Partial passes (if operands agree)
  Sum,     // the op adds operands (accumulates): Partial(sum|avg) only; summed dims allowed
};

// Operand::dims entries that are not a dim of the operand.
constexpr int64_t kAbsent = -1;     // the operand does not run over this logical dim
constexpr int64_t kBroadcast = -2;  // it does, broadcast (a missing leading dim)

struct Operand {
  size_t input = 0;           // index into OpCall::inputs()
  std::vector<int64_t> dims;  // per logical dim: the operand's dim, kAbsent or kBroadcast
  bool broadcast = false;     // a size-1 dim is broadcast (replicated) instead of a mismatch
  bool linear = false;        // Partial may pass through this operand
};

struct Space {
  std::vector<int64_t> size;    // per logical dim
  std::vector<int64_t> out;     // per logical dim: output dim, or -1 (summed over, or absent)
  std::vector<bool> shardable;  // per logical dim
  std::vector<Operand> operands;
  std::vector<bool> as_is;  // per input: left as it is (legacy empty cat inputs)
  Lin lin = Lin::None;
  int inplace = -1;  // input written in place: it must keep its placements

  explicit Space(size_t ninputs) : as_is(ninputs, false) {}
  void add_dim(int64_t sz, int64_t out_dim, bool can_shard) {
    size.push_back(sz);
    out.push_back(out_dim);
    shardable.push_back(can_shard);
    for (auto& o : operands) o.dims.push_back(kAbsent);
  }
  Operand& operand(size_t input, bool linear, bool broadcast = false) {
    operands.push_back(
        Operand{input, std::vector<int64_t>(size.size(), kAbsent), broadcast, linear});
    return operands.back();
  }
};

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
  std::vector<dispatch::Strategy> candidates;
  std::vector<size_t> pick(m, 0);
  while (true) {
    dispatch::Strategy st;
    st.inputs.assign(nin, replicate_all(m));
    for (size_t j = 0; j < nin; ++j) {
      if (s.as_is[j]) st.inputs[j].clear();
    }
    Placements out = replicate_all(m);
    for (int64_t i = 0; i < m; ++i) {
      const Choice& c = options[i][pick[i]];
      if (c.kind == Choice::P) {
        out[i] = c.partial;
        for (const auto& o : s.operands) {
          if (o.linear) st.inputs[o.input][i] = c.partial;
        }
      } else if (c.kind == Choice::S) {
        const size_t L = c.dim;
        const bool summed = s.out[L] < 0;
        out[i] = summed ? Partial() : Shard(s.out[L]);
        for (const auto& o : s.operands) {
          const int64_t d = o.dims[L];
          if (d >= 0 && call.input(o.input).shape()[d] == s.size[L]) {
            st.inputs[o.input][i] = Shard(d);
          } else if (summed && d == kAbsent && o.linear) {
            st.inputs[o.input][i] = Partial();  // counted once over the ranks of this mesh dim
          }
        }
      }
    }
    bool keep = true;
    if (s.inplace >= 0) {
      const auto& cur = call.input(s.inplace).placements();
      keep = std::equal(cur.begin(), cur.end(), st.inputs[s.inplace].begin(),
                        st.inputs[s.inplace].end());
    }
    if (keep) {
      for (int64_t r = 0; r < call.num_returns(); ++r) st.outputs.push_back(out);
      candidates.push_back(std::move(st));
    }
    int64_t i = m - 1;
    while (i >= 0 && ++pick[i] == options[i].size()) pick[i--] = 0;
    if (i < 0) break;
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

// One operand over the first logical dims, in order, except `skip` dims.
Operand& identity_operand(Space& s, size_t input, int64_t ndim, bool linear,
                          std::initializer_list<int64_t> skip = {}) {
  Operand& o = s.operand(input, linear);
  for (int64_t d = 0; d < ndim; ++d) {
    if (std::find(skip.begin(), skip.end(), d) == skip.end()) o.dims[d] = d;
  }
  return o;
}

// A space over `shape` with the same output dims, all shardable except `fixed`.
Space same_shape_space(const OpCall& call, c10::IntArrayRef shape,
                       const std::vector<int64_t>& fixed) {
  Space s(call.num_inputs());
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    s.add_dim(shape[d], d, std::find(fixed.begin(), fixed.end(), d) == fixed.end());
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// cat, stack, split, unbind

bool legacy_empty(const DTensorSpec& t) { return t.ndim() == 1 && t.shape()[0] == 0; }

Decision cat(const OpCall& call) {
  const size_t n = call.num_inputs();
  int64_t ref = -1;
  for (size_t j = 0; j < n && ref < 0; ++j) {
    if (!legacy_empty(call.input(j))) ref = static_cast<int64_t>(j);
  }
  if (ref < 0) {  // only 1-D empty tensors: nothing to move
    return all_outputs(call, std::vector<Placements>(n), replicate_all(call.mesh_ndim()));
  }
  const auto& r = call.input(ref);
  const int64_t dim = wrap_dim(call.int_arg(1, 0), r.ndim());
  std::vector<int64_t> shape = r.shape();
  shape[dim] = 0;
  for (size_t j = 0; j < n; ++j) {
    if (!legacy_empty(call.input(j))) shape[dim] += call.input(j).shape()[dim];
  }
  Space s = same_shape_space(call, shape, {dim});
  s.lin = Lin::Select;
  for (size_t j = 0; j < n; ++j) {
    if (legacy_empty(call.input(j))) {
      s.as_is[j] = true;  // skipped by cat; empty on every rank whatever its layout
    } else {
      identity_operand(s, j, r.ndim(), true, {dim});
    }
  }
  return decide(call, s);
}

Decision stack(const OpCall& call) {
  const auto& r = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(1, 0), r.ndim() + 1);
  Space s(call.num_inputs());
  s.lin = Lin::Select;
  for (int64_t L = 0; L <= r.ndim(); ++L) {
    s.add_dim(L == dim ? static_cast<int64_t>(call.num_inputs()) : r.shape()[L < dim ? L : L - 1],
              L, L != dim);
  }
  for (size_t j = 0; j < call.num_inputs(); ++j) {
    Operand& o = s.operand(j, true);
    for (int64_t L = 0; L <= r.ndim(); ++L) {
      if (L != dim) o.dims[L] = L < dim ? L : L - 1;
    }
  }
  return decide(call, s);
}

// split.Tensor / split_with_sizes (self, sizes, dim): every piece keeps the other dims' layout.
Decision split(const OpCall& call) {
  const auto& in = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(2, 0), in.ndim());
  Space s = same_shape_space(call, in.shape(), {dim});
  s.lin = Lin::Select;
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

// Logical dims = input dims; output dims skip `dim` (select, unbind).
Space dropping_dim_space(const OpCall& call, const DTensorSpec& in, int64_t dim) {
  Space s(call.num_inputs());
  for (int64_t L = 0; L < in.ndim(); ++L) {
    s.add_dim(in.shape()[L], L < dim ? L : (L == dim ? -1 : L - 1), L != dim);
  }
  s.lin = Lin::Select;
  identity_operand(s, 0, in.ndim(), true);
  return s;
}

Decision unbind(const OpCall& call) {
  const auto& in = call.input(0);
  return decide(call, dropping_dim_space(call, in, wrap_dim(call.int_arg(1, 0), in.ndim())));
}

// ---------------------------------------------------------------------------------------------
// slicing and selecting

// Whether slice(dim, start, end, step) keeps all of a dim of size n.
bool whole_slice(const c10::IValue& start, const c10::IValue& end, int64_t step, int64_t n) {
  int64_t b = start.isNone() ? 0 : start.toInt();
  int64_t e = end.isNone() ? n : end.toInt();
  if (b < 0) b += n;
  if (e < 0) e += n;
  return step == 1 && b <= 0 && e >= n;
}

Decision slice(const OpCall& call) {
  const auto& in = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(1, 0), in.ndim());
  const bool whole = whole_slice(call.arg(2), call.arg(3), call.int_arg(4, 1), in.shape()[dim]);
  Space s = same_shape_space(call, in.shape(),
                             whole ? std::vector<int64_t>{} : std::vector<int64_t>{dim});
  s.lin = Lin::Select;
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

// Backward ops that build a zero tensor of `input_sizes` (arg 1) around the gradient: the
// sizes are rewritten to this rank's shard of the result.
Decision with_local_sizes(const OpCall& call, Decision d, c10::IntArrayRef global_sizes) {
  d.local_args.push_back(
      {1, c10::IValue(local_shape_of(call.mesh(), global_sizes, *d.outputs[0]))});
  return d;
}

// slice_backward(grad, input_sizes, dim, start, end, step)
Decision slice_backward(const OpCall& call) {
  const auto& g = call.input(0);
  const auto sizes = call.int_list_arg(1);
  const int64_t dim = wrap_dim(call.int_arg(2), static_cast<int64_t>(sizes.size()));
  const bool whole = g.shape()[dim] == sizes[dim];
  Space s =
      same_shape_space(call, sizes, whole ? std::vector<int64_t>{} : std::vector<int64_t>{dim});
  s.lin = Lin::Select;
  Operand& o = identity_operand(s, 0, g.ndim(), true);
  if (!whole) o.dims[dim] = -1;
  return with_local_sizes(call, decide(call, s), sizes);
}

Decision select(const OpCall& call) {
  const auto& in = call.input(0);
  return decide(call, dropping_dim_space(call, in, wrap_dim(call.int_arg(1), in.ndim())));
}

// select_backward(grad, input_sizes, dim, index)
Decision select_backward(const OpCall& call) {
  const auto sizes = call.int_list_arg(1);
  const int64_t nd = static_cast<int64_t>(sizes.size());
  const int64_t dim = wrap_dim(call.int_arg(2), nd);
  Space s = same_shape_space(call, sizes, {dim});
  s.lin = Lin::Select;
  Operand& o = s.operand(0, true);
  for (int64_t L = 0; L < nd; ++L) {
    if (L != dim) o.dims[L] = L < dim ? L : L - 1;
  }
  return with_local_sizes(call, decide(call, s), sizes);
}

// slice_scatter(self, src, dim, start, end, step) / select_scatter(self, src, dim, index)
Decision slice_scatter(const OpCall& call) {
  const auto& self = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(2, 0), self.ndim());
  const bool whole = whole_slice(call.arg(3), call.arg(4), call.int_arg(5, 1), self.shape()[dim]);
  Space s = same_shape_space(call, self.shape(),
                             whole ? std::vector<int64_t>{} : std::vector<int64_t>{dim});
  s.lin = Lin::Select;
  identity_operand(s, 0, self.ndim(), true);
  Operand& src = identity_operand(s, 1, self.ndim(), true);
  if (!whole) src.dims[dim] = -1;
  return decide(call, s);
}

Decision select_scatter(const OpCall& call) {
  const auto& self = call.input(0);
  const int64_t dim = wrap_dim(call.int_arg(2), self.ndim());
  Space s = same_shape_space(call, self.shape(), {dim});
  s.lin = Lin::Select;
  identity_operand(s, 0, self.ndim(), true);
  Operand& src = s.operand(1, true);
  for (int64_t L = 0; L < self.ndim(); ++L) {
    if (L != dim) src.dims[L] = L < dim ? L : L - 1;
  }
  return decide(call, s);
}

// ---------------------------------------------------------------------------------------------
// advanced indexing: index, index_put, index_select, index_add, gather, scatter

// Where self[indices] puts things: the broadcast index shape forms a block that replaces the
// indexed dims (in place when they are adjacent, in front otherwise).
struct IndexLayout {
  std::vector<int64_t> self_out;                         // per self dim: result dim, -1 if indexed
  std::vector<int64_t> block;                            // broadcast shape of the index tensors
  int64_t block_start = 0;                               // result dim of block[0]
  std::vector<int64_t> shape;                            // result shape
  std::vector<std::pair<size_t, int64_t>> index_inputs;  // (input, indexed self dim)
};

IndexLayout index_layout(const OpCall& call, int indices_arg) {
  const auto& self = call.input(0);
  const int64_t n = self.ndim();
  IndexLayout l;
  std::vector<bool> indexed(n, false);
  for (size_t j = 0; j < call.num_inputs(); ++j) {
    const auto& in = call.inputs()[j];
    if (in.arg != indices_arg || !in.spec) continue;
    const auto dt = in.spec->dtype();
    TORCH_CHECK(dt != at::kBool && dt != at::kByte, call.name(), ": indexing a DTensor with a ",
                "boolean mask is not supported (its result shape depends on the data); use "
                "masked_fill/where, or integer indices");
    indexed.at(in.list_index) = true;
    l.index_inputs.push_back({j, in.list_index});
    // broadcast the block shape
    const auto& sh = in.spec->shape();
    const size_t bn = std::max(l.block.size(), sh.size());
    std::vector<int64_t> b(bn, 1);
    for (size_t k = 0; k < l.block.size(); ++k) b[bn - l.block.size() + k] = l.block[k];
    for (size_t k = 0; k < sh.size(); ++k) {
      int64_t& x = b[bn - sh.size() + k];
      if (sh[k] != 1) x = sh[k];
    }
    l.block = std::move(b);
  }
  int64_t first = -1, last = -1;
  for (int64_t d = 0; d < n; ++d) {
    if (!indexed[d]) continue;
    if (first < 0) first = d;
    last = d;
  }
  bool adjacent = true;
  for (int64_t d = first; d >= 0 && d <= last; ++d) adjacent &= indexed[d];
  l.self_out.assign(n, -1);
  const int64_t nb = static_cast<int64_t>(l.block.size());
  if (first < 0) {
    for (int64_t d = 0; d < n; ++d) l.self_out[d] = d;
    l.shape = self.shape();
    return l;
  }
  l.block_start = adjacent ? first : 0;
  int64_t pos = 0;
  for (int64_t d = 0; d < n; ++d) {
    if (pos == l.block_start) {
      for (auto b : l.block) l.shape.push_back(b);
      pos += nb;
    }
    if (indexed[d]) continue;
    l.self_out[d] = pos++;
    l.shape.push_back(self.shape()[d]);
  }
  if (pos == l.block_start) {
    for (auto b : l.block) l.shape.push_back(b);
  }
  return l;
}

// Index tensor `j` runs over the block dims starting at logical dim `base` (right-aligned).
void add_index_operand(Space& s, const OpCall& call, const IndexLayout& l, size_t j, int64_t base) {
  const auto& t = call.input(j);
  Operand& o = s.operand(j, false, /*broadcast=*/true);
  const int64_t off = static_cast<int64_t>(l.block.size()) - t.ndim();
  for (int64_t k = 0; k < t.ndim(); ++k) o.dims[base + off + k] = k;
}

// index.Tensor / _unsafe_index.Tensor (self, indices): the indexed dims of self replicated,
// the index tensors sharded together (pointwise) on the result's block dims.
Decision index(const OpCall& call) {
  const auto& self = call.input(0);
  const IndexLayout l = index_layout(call, 1);
  Space s(call.num_inputs());
  for (size_t L = 0; L < l.shape.size(); ++L) s.add_dim(l.shape[L], static_cast<int64_t>(L), true);
  s.lin = Lin::Select;
  Operand& o = s.operand(0, true);
  for (int64_t d = 0; d < self.ndim(); ++d) {
    if (l.self_out[d] >= 0) o.dims[l.self_out[d]] = d;
  }
  for (const auto& [j, d] : l.index_inputs) add_index_operand(s, call, l, j, l.block_start);
  return decide(call, s);
}

// index_put(_) / _index_put_impl(_) (self, indices, values, accumulate[, unsafe]): logical
// dims are self's, then the index block, which an accumulating put may shard (result Partial).
Decision index_put(const OpCall& call, bool inplace) {
  const auto& self = call.input(0);
  const IndexLayout l = index_layout(call, 1);
  const bool accumulate = call.bool_arg(3, false);
  const int64_t n = self.ndim();
  const int64_t nb = static_cast<int64_t>(l.block.size());
  Space s(call.num_inputs());
  for (int64_t d = 0; d < n; ++d) s.add_dim(self.shape()[d], d, l.self_out[d] >= 0);
  for (int64_t b = 0; b < nb; ++b) s.add_dim(l.block[b], -1, accumulate);
  s.lin = accumulate ? Lin::Sum : Lin::Select;
  s.inplace = inplace ? 0 : -1;
  identity_operand(s, 0, n, true);
  size_t values = 0;
  for (size_t j = 0; j < call.num_inputs(); ++j) {
    if (call.inputs()[j].arg == 2) values = j;
  }
  // values broadcast to the shape of self[indices]
  const auto& v = call.input(values);
  Operand& vo = s.operand(values, true, /*broadcast=*/true);
  const int64_t off = static_cast<int64_t>(l.shape.size()) - v.ndim();
  auto value_dim = [&](int64_t result_dim) {
    return result_dim - off >= 0 ? result_dim - off : kBroadcast;
  };
  for (int64_t d = 0; d < n; ++d) {
    if (l.self_out[d] >= 0) vo.dims[d] = value_dim(l.self_out[d]);
  }
  for (int64_t b = 0; b < nb; ++b) vo.dims[n + b] = value_dim(l.block_start + b);
  for (const auto& [j, d] : l.index_inputs) add_index_operand(s, call, l, j, n);
  return decide(call, s);
}

// index_select(self, dim, index): the selected dim follows a 1-D index's layout.
Decision index_select(const OpCall& call) {
  const auto& self = call.input(0);
  const auto& idx = call.input(1);
  const int64_t dim = wrap_dim(call.int_arg(1), self.ndim());
  std::vector<int64_t> shape = self.shape();
  if (self.ndim() > 0) {
    int64_t numel = 1;
    for (auto x : idx.shape()) numel *= x;
    shape[dim] = numel;
  }
  Space s = same_shape_space(call, shape, {});
  s.lin = Lin::Select;
  identity_operand(s, 0, self.ndim(), true, {dim});
  if (idx.ndim() == 1 && self.ndim() > 0) s.operand(1, false).dims[dim] = 0;
  return decide(call, s);
}

// index_add(self, dim, index, source, alpha): the index/source position along `dim` is a
// summed dim; sharding it gives a Partial sum.
Decision index_add(const OpCall& call, bool inplace) {
  const auto& self = call.input(0);
  const auto& idx = call.input(1);
  const int64_t n = self.ndim();
  const int64_t dim = wrap_dim(call.int_arg(1), n);
  Space s = same_shape_space(call, self.shape(), {dim});
  s.add_dim(idx.ndim() == 1 ? idx.shape()[0] : 1, -1, idx.ndim() == 1 && n > 0);
  s.lin = Lin::Sum;
  s.inplace = inplace ? 0 : -1;
  identity_operand(s, 0, n, true);
  Operand& src = identity_operand(s, 2, n, true, {dim});
  if (n > 0) src.dims[n] = dim;
  if (idx.ndim() == 1) s.operand(1, false).dims[n] = 0;
  return decide(call, s);
}

// gather(self, dim, index): iterates over index; self's other dims go with index's.
Decision gather(const OpCall& call) {
  const auto& self = call.input(0);
  const auto& idx = call.input(1);
  const int64_t dim = wrap_dim(call.int_arg(1), std::max(self.ndim(), idx.ndim()));
  Space s = same_shape_space(call, idx.shape(), {});
  s.lin = Lin::Select;
  if (self.ndim() == idx.ndim()) identity_operand(s, 0, self.ndim(), true, {dim});
  identity_operand(s, 1, idx.ndim(), false);
  return decide(call, s);
}

enum class ScatterKind { Src, Add, Value };

// scatter(self, dim, index, src|value[, reduce]) / scatter_add: self's dims, plus the
// index position along `dim` (a summed dim for scatter_add).
Decision scatter(const OpCall& call, ScatterKind kind, bool inplace) {
  const auto& self = call.input(0);
  const auto& idx = call.input(1);
  const int64_t n = self.ndim();
  const int64_t dim = wrap_dim(call.int_arg(1), n);
  Space s = same_shape_space(call, self.shape(), {dim});
  const bool same_rank = idx.ndim() == n && n > 0;
  s.add_dim(same_rank ? idx.shape()[dim] : 1, -1, same_rank && kind == ScatterKind::Add);
  s.lin = kind == ScatterKind::Add ? Lin::Sum : kind == ScatterKind::Src ? Lin::Select : Lin::None;
  s.inplace = inplace ? 0 : -1;
  identity_operand(s, 0, n, true);
  if (same_rank) {
    for (size_t j = 1; j < call.num_inputs(); ++j) {
      Operand& o = identity_operand(s, j, n, j == 2, {dim});
      o.dims[n] = dim;
    }
  }
  return decide(call, s);
}

// ---------------------------------------------------------------------------------------------
// repeat, roll, flip, triangles, padding, complex views

Decision repeat(const OpCall& call) {
  const auto& in = call.input(0);
  const auto reps = call.int_list_arg(1);
  const int64_t nd = static_cast<int64_t>(reps.size());
  const int64_t off = nd - in.ndim();
  Space s(call.num_inputs());
  for (int64_t L = 0; L < nd; ++L) {
    const int64_t base = L >= off ? in.shape()[L - off] : 1;
    s.add_dim(base * reps[L], L, L >= off && reps[L] == 1);
  }
  s.lin = Lin::Select;
  Operand& o = s.operand(0, true);
  for (int64_t d = 0; d < in.ndim(); ++d) o.dims[d + off] = d;
  return decide(call, s);
}

// Ops that move elements along some dims (which must be whole) and keep the others.
Decision along_dims(const OpCall& call, std::vector<int64_t> dims, Lin lin) {
  const auto& in = call.input(0);
  for (auto& d : dims) d = wrap_dim(d, in.ndim());
  Space s = same_shape_space(call, in.shape(), dims);
  s.lin = lin;
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

Decision roll(const OpCall& call) {
  auto dims = call.int_list_arg(2);
  if (dims.empty()) dims = iota(call.input(0).ndim());  // rolls the flattened tensor
  return along_dims(call, dims, Lin::Select);
}

Decision flip(const OpCall& call) { return along_dims(call, call.int_list_arg(1), Lin::Select); }

// triu/tril: the mask depends on the position in the last two dims. Zeroing is linear.
Decision triangle(const OpCall& call) {
  const int64_t nd = call.input(0).ndim();
  return along_dims(call, {nd - 2, nd - 1}, Lin::Select);
}

// constant_pad_nd(self, pad, value): padded dims whole. The pad value is not part of the
// cache key, so Partial is always reduced (a non-zero value would be added once per rank).
Decision constant_pad(const OpCall& call) {
  const int64_t nd = call.input(0).ndim();
  const auto pad = call.int_list_arg(1);
  std::vector<int64_t> dims;
  // pad holds (before, after) pairs starting from the last dim
  for (int64_t k = 0; 2 * k < static_cast<int64_t>(pad.size()) && k < nd; ++k) {
    const int64_t before = pad[2 * k];
    const int64_t after = 2 * k + 1 < static_cast<int64_t>(pad.size()) ? pad[2 * k + 1] : 0;
    if (before != 0 || after != 0) dims.push_back(nd - 1 - k);
  }
  return along_dims(call, dims, Lin::None);
}

// view_as_complex: the trailing pair becomes one complex element; view_as_real splits it.
Decision view_as_complex(const OpCall& call) {
  const auto& in = call.input(0);
  const int64_t last = in.ndim() - 1;
  Space s(call.num_inputs());
  for (int64_t L = 0; L < in.ndim(); ++L) s.add_dim(in.shape()[L], L == last ? -1 : L, L != last);
  s.lin = Lin::Sum;  // complex sums are sums of their parts
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

Decision view_as_real(const OpCall& call) {
  const auto& in = call.input(0);
  Space s = same_shape_space(call, in.shape(), {});
  s.add_dim(2, in.ndim(), false);
  s.lin = Lin::Sum;
  identity_operand(s, 0, in.ndim(), true);
  return decide(call, s);
}

// ---------------------------------------------------------------------------------------------
// comparisons of whole tensors

// equal(self, other): both laid out like the operand with more shards; every rank compares its
// shards and the answers are combined over the sharded mesh dims, so all ranks agree.
Decision equal(const OpCall& call) {
  const auto& a = call.input(0);
  const auto& b = call.input(1);
  Decision d;
  d.outputs = {std::nullopt};
  d.output_meta = {std::nullopt};  // data-dependent: never run on meta tensors
  if (a.shape() != b.shape()) {
    d.inputs = {{}, {}};
    d.local_kernel = [](const c10::OperatorHandle&, torch::jit::Stack& st,
                        const dispatch::LocalContext&) {
      torch::jit::drop(st, 2);
      st.emplace_back(false);
    };
    return d;
  }
  // More shards wins (counting Shard mesh dims too, so size-1 mesh dims break ties).
  auto rank_of = [](const DTensorSpec& t) {
    int64_t dims = 0;
    for (const auto& p : t.placements()) dims += p.is_shard() ? 1 : 0;
    return std::make_pair(t.num_shards(), dims);
  };
  const Placements target =
      clear_partial(rank_of(b) > rank_of(a) ? b.placements() : a.placements());
  d.inputs = {target, target};
  std::vector<int64_t> sharded;
  for (size_t i = 0; i < target.size(); ++i) {
    const auto md = static_cast<int64_t>(i);
    if (target[i].is_shard() && call.mesh().size(md) > 1) sharded.push_back(md);
  }
  d.local_kernel = [sharded](const c10::OperatorHandle&, torch::jit::Stack& st,
                             const dispatch::LocalContext& ctx) {
    const at::Tensor x = st[st.size() - 2].toTensor();
    const at::Tensor y = st[st.size() - 1].toTensor();
    bool eq = at::equal(x, y);
    if (!sharded.empty()) {
      const DeviceMesh& mesh = ctx.inputs[0]->mesh();
      at::Tensor flag = at::scalar_tensor(eq ? 1 : 0, x.options().dtype(at::kInt));
      for (int64_t i : sharded) flag = comm::all_reduce(flag, ReduceOp::Min, mesh.group(i));
      eq = flag.item<int>() != 0;
    }
    torch::jit::drop(st, 2);
    st.emplace_back(eq);
  };
  return d;
}

// is_same_size: answered from the global shapes, without moving anything.
Decision is_same_size(const OpCall& call) {
  Decision d;
  d.inputs = {{}, {}};
  d.outputs = {std::nullopt};
  d.output_meta = {std::nullopt};
  const bool same = call.input(0).shape() == call.input(1).shape();
  d.local_kernel = [same](const c10::OperatorHandle&, torch::jit::Stack& st,
                          const dispatch::LocalContext&) {
    torch::jit::drop(st, 2);
    st.emplace_back(same);
  };
  return d;
}

}  // namespace

DTENSOR_RULES(index_ops) {
  using dispatch::register_rule;
  register_rule("aten::cat", cat);
  register_rule("aten::stack", stack);
  register_rule({"aten::split.Tensor", "aten::split_with_sizes", "aten::unsafe_split.Tensor",
                 "aten::unsafe_split_with_sizes"},
                split);
  register_rule("aten::unbind.int", unbind);
  register_rule("aten::slice.Tensor", slice);
  register_rule("aten::slice_backward", slice_backward);
  register_rule("aten::slice_scatter", slice_scatter);
  register_rule("aten::select.int", select);
  register_rule("aten::select_backward", select_backward);
  register_rule("aten::select_scatter", select_scatter);
  register_rule({"aten::index.Tensor", "aten::_unsafe_index.Tensor"}, index);
  register_rule({"aten::index_put", "aten::_index_put_impl"},
                [](const OpCall& c) { return index_put(c, false); });
  register_rule({"aten::index_put_", "aten::_index_put_impl_"},
                [](const OpCall& c) { return index_put(c, true); });
  register_rule("aten::index_select", index_select);
  register_rule("aten::index_add", [](const OpCall& c) { return index_add(c, false); });
  register_rule("aten::index_add_", [](const OpCall& c) { return index_add(c, true); });
  register_rule("aten::gather", gather);
  register_rule("aten::scatter.src",
                [](const OpCall& c) { return scatter(c, ScatterKind::Src, false); });
  register_rule("aten::scatter_.src",
                [](const OpCall& c) { return scatter(c, ScatterKind::Src, true); });
  register_rule("aten::scatter_add",
                [](const OpCall& c) { return scatter(c, ScatterKind::Add, false); });
  register_rule("aten::scatter_add_",
                [](const OpCall& c) { return scatter(c, ScatterKind::Add, true); });
  register_rule({"aten::scatter.value", "aten::scatter.reduce", "aten::scatter.value_reduce"},
                [](const OpCall& c) { return scatter(c, ScatterKind::Value, false); });
  register_rule({"aten::scatter_.value", "aten::scatter_.reduce", "aten::scatter_.value_reduce"},
                [](const OpCall& c) { return scatter(c, ScatterKind::Value, true); });
  register_rule("aten::repeat", repeat);
  register_rule("aten::roll", roll);
  register_rule("aten::flip", flip);
  register_rule({"aten::triu", "aten::tril"}, triangle);
  register_rule("aten::constant_pad_nd", constant_pad);
  register_rule("aten::view_as_complex", view_as_complex);
  register_rule("aten::view_as_real", view_as_real);
  register_rule("aten::equal", equal);
  register_rule("aten::is_same_size", is_same_size);
}

}  // namespace dtensor::ops
