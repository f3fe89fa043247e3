// Tensor ops that copy, alias, create-like or read scalars
// (docs/ARCHITECTURE.md, "Tensor ops and indexing").
#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

// Output follows the first input exactly (Partial included): clone, detach, alias, casts.
Decision follow_input(const OpCall& call) {
  const Placements& p = call.input(0).placements();
  std::vector<Placements> inputs{p};
  for (size_t j = 1; j < call.num_inputs(); ++j) inputs.push_back(replicate_all(call.mesh_ndim()));
  return all_outputs(call, std::move(inputs), p);
}

// *_like: same layout as the input, but values are not partial sums.
Decision like(const OpCall& call) {
  const Placements& p = call.input(0).placements();
  return all_outputs(call, {p}, clear_partial(p));
}

// new_empty/new_zeros/new_ones/new_full(self, size, ...): follow self when the size matches
// (so optimizer state keeps the parameter's layout), else Replicate.
Decision new_factory(const OpCall& call) {
  const DTensorSpec& self = call.input(0);
  std::vector<int64_t> size = call.int_list_arg(1);
  Placements out =
      size == self.shape() ? clear_partial(self.placements()) : replicate_all(call.mesh_ndim());
  Decision d = all_outputs(call, {self.placements()}, out);
  d.local_args.push_back({1, c10::IValue(local_shape_of(call.mesh(), size, out))});
  return d;
}

Decision new_empty_strided(const OpCall& call) {
  Decision d = new_factory(call);
  const auto local = d.local_args[0].second.toIntVector();
  d.local_args.push_back({2, c10::IValue(strides_like(local, call.int_list_arg(2)))});
  return d;
}

// copy_(self, src): self keeps its layout, src is moved to it.
Decision copy_into(const OpCall& call) {
  const Placements& p = call.input(0).placements();
  const auto& src = call.input(1);
  Placements sp;
  const int64_t off = call.input(0).ndim() - src.ndim();
  for (const auto& x : p) {
    if (x.is_shard()) {
      const int64_t d = x.dim() - off;
      sp.push_back(d < 0 || src.shape()[d] == 1 ? Replicate() : Shard(d));
    } else {
      sp.push_back(x);
    }
  }
  return all_outputs(call, {p, sp}, p);
}

// fill_(self, value) on a Partial tensor would multiply the value: replicate first.
Decision fill(const OpCall& call) {
  const Placements p = clear_partial(call.input(0).placements());
  std::vector<Placements> inputs{p};
  for (size_t j = 1; j < call.num_inputs(); ++j) inputs.push_back(replicate_all(call.mesh_ndim()));
  return all_outputs(call, std::move(inputs), p);
}

// .item(): a replicated value (a Partial is reduced first: every rank must call it).
Decision local_scalar(const OpCall& call) {
  Decision d;
  d.inputs = {replicate_all(call.mesh_ndim())};
  d.outputs = {std::nullopt};
  d.output_meta = {std::nullopt};
  return d;
}

}  // namespace

DTENSOR_RULES(tensor_ops) {
  using dispatch::register_rule;
  register_rule({"aten::clone", "aten::detach", "aten::alias", "aten::_to_copy", "aten::lift_fresh",
                 "aten::_conj_physical", "aten::view.dtype", "aten::_assert_tensor_metadata",
                 "aten::resolve_conj", "aten::resolve_neg"},
                follow_input);
  // rand_like & co. draw from DTensor's stream: see random_ops.cpp.
  register_rule({"aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like"},
                like);
  register_rule({"aten::new_empty", "aten::new_zeros", "aten::new_ones", "aten::new_full"},
                new_factory);
  register_rule("aten::new_empty_strided", new_empty_strided);
  register_rule("aten::copy_", copy_into);
  register_rule({"aten::fill_.Scalar", "aten::fill_.Tensor"}, fill);
  register_rule("aten::zero_", follow_input);  // zeros stay zeros under any reduction
  register_rule("aten::_local_scalar_dense", local_scalar);
}

}  // namespace dtensor::ops
