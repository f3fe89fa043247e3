// Linear algebra and diagonals (docs/ARCHITECTURE.md, "Linear algebra and diagonals"). A
// decomposition (svd, eigh, qr) needs whole matrices: the two matrix dims are replicated and the
// batch dims keep their shards, every factor sharded like the input's batch. A diagonal reads
// across its two dims: they are replicated, the other dims keep their shards.
#include "dtensor/ops/rule_utils.h"
#include "strategy/iteration_space.h"

namespace dtensor::ops {
namespace {

// Every input but the first replicated.
std::vector<Placements> first_input_as(const OpCall& call, const Placements& p) {
  std::vector<Placements> inputs{p};
  for (size_t j = 1; j < call.num_inputs(); ++j) inputs.push_back(replicate_all(call.mesh_ndim()));
  return inputs;
}

// A decomposition of (batches of) matrices: returns with `has_values[r]` false are the empty
// placeholders an op returns for factors it was told not to compute (replicated).
Decision batched_matrices(const OpCall& call, const std::vector<bool>& has_values) {
  const DTensorSpec& in = call.input(0);
  const int64_t batch = in.ndim() - 2;
  const Placements p = keep_shards(in.placements(), [&](int64_t d) { return d < batch; });
  Decision d;
  d.inputs = first_input_as(call, p);
  for (bool v : has_values) d.outputs.push_back(v ? p : replicate_all(call.mesh_ndim()));
  return d;
}

// linalg_solve_triangular(A, B, *, upper, left, unitriangular): one triangular solve per
// batch. The batch dims broadcast as in an element-wise op and may be sharded (A's with B's
// where A has them, else A replicated), the matrix dims stay whole; linear in B, so a pending
// sum of B passes to the result (PyTorch's strategies for it).
Decision solve_triangular(const OpCall& call) {
  using namespace iteration;
  const DTensorSpec& a = call.input(0);
  const DTensorSpec& b = call.input(1);
  TORCH_CHECK_VALUE(a.ndim() >= 2 && b.ndim() >= 2, call.name(),
                    ": A and B must be (batches of) matrices, got inputs ", call.placements_str());
  const int64_t batch = std::max(a.ndim(), b.ndim()) - 2;
  // Operand dim of logical batch dim L (right-aligned), or kBroadcast where it has none.
  auto dim_of = [&](const DTensorSpec& t, int64_t L) {
    const int64_t d = L - (batch - (t.ndim() - 2));
    return d < 0 ? kBroadcast : d;
  };
  Space s(call.num_inputs());
  for (int64_t L = 0; L < batch; ++L) {
    const int64_t da = dim_of(a, L), db = dim_of(b, L);
    s.add_dim(std::max(da < 0 ? 1 : a.shape()[da], db < 0 ? 1 : b.shape()[db]), L, true);
  }
  // The result has B's matrix dims.
  s.add_dim(b.shape()[b.ndim() - 2], batch, false);
  s.add_dim(b.shape()[b.ndim() - 1], batch + 1, false);
  s.lin = Lin::Sum;
  for (size_t j = 0; j < 2; ++j) {
    const DTensorSpec& t = call.input(j);
    Operand& o = s.operand(j, /*linear=*/j == 1, /*broadcast=*/true);
    for (int64_t L = 0; L < batch; ++L) o.dims[L] = dim_of(t, L);
    if (j == 1) {
      o.dims[batch] = t.ndim() - 2;
      o.dims[batch + 1] = t.ndim() - 1;
    }
  }
  return decide(call, s);
}

// diagonal(self, offset, dim1, dim2) and linalg_diagonal(A, *, offset, dim1, dim2): the other
// dims in order, then the diagonal.
std::vector<std::optional<int64_t>> diagonal_dim_map(int64_t nd, int64_t dim1, int64_t dim2) {
  std::vector<std::optional<int64_t>> map(nd);
  int64_t next = 0;
  for (int64_t d = 0; d < nd; ++d) {
    if (d != dim1 && d != dim2) map[d] = next++;
  }
  return map;
}

Decision diagonal(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const int64_t nd = in.ndim();
  const auto map =
      diagonal_dim_map(nd, wrap_dim(call.int_arg(2), nd), wrap_dim(call.int_arg(3), nd));
  const Placements p = keep_shards(in.placements(), [&](int64_t d) { return map[d].has_value(); });
  return all_outputs(call, {p}, remap_shards(p, [&](int64_t d) { return map[d]; }));
}

// A sum passes through an op that only places each element somewhere among zeros.
bool linear_partial(const Placement& x) {
  return x.is_partial() && !x.is_norm_partial() &&
         (x.reduce_op() == ReduceOp::Sum || x.reduce_op() == ReduceOp::Avg);
}

// The placements of a linear op that moves input dim d to output dim to[d] (d < to.size()): such
// shards follow, a pending sum passes, anything else is gathered. Returns {input, output}.
std::pair<Placements, Placements> follow_dim_map(const Placements& in,
                                                 const std::vector<int64_t>& to) {
  Placements tgt, out;
  for (const auto& x : in) {
    if (x.is_shard() && x.dim() < static_cast<int64_t>(to.size())) {
      tgt.push_back(x);
      out.push_back(Shard(to[x.dim()]));
    } else if (linear_partial(x)) {
      tgt.push_back(x);
      out.push_back(x);
    } else {
      tgt.push_back(Replicate());
      out.push_back(Replicate());
    }
  }
  return {tgt, out};
}

// diagonal_backward(grad_output, input_sizes, offset, dim1, dim2): zeros of input_sizes with the
// gradient on the diagonal. The gradient's dims map back to the input's other dims; its
// diagonal dim is replicated; a pending sum passes (the zeros add nothing).
Decision diagonal_backward(const OpCall& call) {
  const DTensorSpec& grad = call.input(0);
  const auto sizes = call.int_list_arg(1);
  const int64_t nd = static_cast<int64_t>(sizes.size());
  const auto map =
      diagonal_dim_map(nd, wrap_dim(call.int_arg(3), nd), wrap_dim(call.int_arg(4), nd));
  std::vector<int64_t> back;  // grad dim -> input dim
  for (int64_t d = 0; d < nd; ++d) {
    if (map[d]) back.push_back(d);
  }
  const auto [tgt, out] = follow_dim_map(grad.placements(), back);
  Decision d = all_outputs(call, {tgt}, out);
  d.local_args.push_back({1, c10::IValue(local_shape_of(call.mesh(), sizes, out))});
  return d;
}

// diag_embed(self, offset, dim1, dim2): the last input dim becomes the diagonal of output dims
// dim1 and dim2; the other input dims fill the remaining output dims in order. Linear, so a
// pending sum passes.
Decision diag_embed(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const int64_t nd = in.ndim() + 1;
  const int64_t dim1 = wrap_dim(call.int_arg(2, -2), nd), dim2 = wrap_dim(call.int_arg(3, -1), nd);
  std::vector<int64_t> to_out;  // input dim -> output dim (all but the last)
  for (int64_t d = 0; d < nd; ++d) {
    if (d != dim1 && d != dim2) to_out.push_back(d);
  }
  const auto [tgt, out] = follow_dim_map(in.placements(), to_out);
  return all_outputs(call, {tgt}, out);
}

// Everything replicated.
Decision replicated(const OpCall& call) {
  const Placements r = replicate_all(call.mesh_ndim());
  return all_outputs(call, std::vector<Placements>(call.num_inputs(), r), r);
}

}  // namespace

DTENSOR_RULES(linalg_ops) {
  using dispatch::register_rule;
  // _linalg_svd(A, full_matrices, compute_uv, driver) -> (U, S, Vh)
  register_rule("aten::_linalg_svd", [](const OpCall& c) {
    const bool uv = c.bool_arg(2, true);
    return batched_matrices(c, {uv, true, uv});
  });
  // _linalg_eigh(A, UPLO, compute_v) -> (eigenvalues, eigenvectors)
  register_rule("aten::_linalg_eigh", [](const OpCall& c) {
    return batched_matrices(c, {true, c.bool_arg(2, true)});
  });
  // linalg_qr(A, mode) -> (Q, R); mode "r" leaves Q empty
  register_rule("aten::linalg_qr", [](const OpCall& c) {
    const bool q = !c.arg(1).isString() || c.arg(1).toStringRef() != "r";
    return batched_matrices(c, {q, true});
  });
  register_rule("aten::linalg_solve_triangular", solve_triangular);
  register_rule({"aten::diagonal", "aten::diagonal_copy", "aten::linalg_diagonal"}, diagonal);
  register_rule("aten::diagonal_backward", diagonal_backward);
  register_rule("aten::diag_embed", diag_embed);
  // diag, and hash_tensor (one value from every element): replicated. linalg_pinv with
  // tolerance tensors: those broadcast against the batch, so everything is replicated.
  register_rule({"aten::diag", "aten::hash_tensor"}, replicated);
  register_rule("aten::linalg_pinv.atol_rtol_tensor", [](const OpCall& c) {
    Decision d = replicated(c);
    std::vector<int64_t> shape = c.input(0).shape();  // no meta kernel: (*, n, m) -> (*, m, n)
    std::swap(shape[shape.size() - 1], shape[shape.size() - 2]);
    d.output_meta = {contiguous_meta(shape, c.input(0).dtype())};
    return d;
  });
}

}  // namespace dtensor::ops
