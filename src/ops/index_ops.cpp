// Advanced indexing: index, index_put, index_select, index_add, gather, scatter, as iteration
// spaces (strategy/iteration_space.h).
#include "dtensor/ops/rule_utils.h"
#include "strategy/iteration_space.h"

namespace dtensor::ops {
namespace {

using namespace iteration;  // Space, Operand, Lin, decide, ...

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

// bucketize.Tensor(self, boundaries, *, out_int32, right): each element is looked up alone in
// the whole (replicated) boundaries, so self's shards stay.
Decision bucketize(const OpCall& call) {
  const Placements p = keep_shards(call.input(0).placements(), [](int64_t) { return true; });
  Decision d = all_outputs(call, {p, replicate_all(call.mesh_ndim())}, p);
  d.output_meta = {contiguous_meta(call.input(0).shape(), proxy_result_dtype(call))};  // no meta
  return d;
}

// nonzero_static(self, *, size, fill_value): the positions of the nonzero elements in order, a
// search over the whole tensor: replicated.
Decision nonzero_static(const OpCall& call) {
  const Placements r = replicate_all(call.mesh_ndim());
  Decision d = all_outputs(call, {r}, r);
  d.output_meta = {contiguous_meta({call.int_arg(1), call.input(0).ndim()}, at::kLong)};
  return d;
}

}  // namespace

DTENSOR_RULES(index_ops) {
  using dispatch::register_rule;
  register_rule({"aten::index.Tensor", "aten::_unsafe_index.Tensor"}, index);
  register_rule({"aten::index_put", "aten::_index_put_impl"},
                [](const OpCall& c) { return index_put(c, false); });
  register_rule({"aten::index_put_", "aten::_index_put_impl_"},
                [](const OpCall& c) { return index_put(c, true); });
  register_rule("aten::index_select", index_select);
  register_rule("aten::index_add", [](const OpCall& c) { return index_add(c, false); });
  register_rule("aten::index_add_", [](const OpCall& c) { return index_add(c, true); });
  register_rule("aten::gather", gather);
  register_rule("aten::bucketize.Tensor", bucketize);
  register_rule("aten::nonzero_static", nonzero_static);
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
}

}  // namespace dtensor::ops
