// Embedding lookups. Candidates per mesh dim, in PyTorch's order [output | weight, indices]:
// all Replicate; colwise [Shard(last) | Shard(1), R]; rowwise [Partial | Shard(0), R]; batch
// [Shard(d) | R, Shard(d)] for each index dim d. They are combined over mesh dims and the
// cheapest is chosen with PyTorch's tie-break.
//
// Rowwise: PyTorch moves the indices to a mask placement that remembers which ids fall outside
// this rank's rows, and zeroes those rows when the output is reduced. Here the local lookup
// itself shifts, clamps and zeroes (a LocalKernel), so the output is an ordinary Partial(sum)
// and no mask has to outlive the op.
#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

// Placements on one mesh dim: [output, weight, indices] (embedding) or [grad_weight,
// grad_output, indices] (its backward).
DimStrategy choice(Placement out, Placement first, Placement second) {
  return {out, first, second};
}

// Lookup in this rank's rows of a row-sharded weight: ids of other ranks' rows give zeros.
void masked_lookup(const c10::OperatorHandle& op, torch::jit::Stack& st,
                   const dispatch::LocalContext& ctx) {
  // (weight, indices, padding_idx, scale_grad_by_freq, sparse)
  const size_t base = st.size() - 5;
  const LocalShard rows = ctx.inputs[0]->local_shard();
  const at::Tensor weight = st[base].toTensor();
  const at::Tensor ids = st[base + 1].toTensor() - rows.offset[0];
  const at::Tensor outside = ids.lt(0).logical_or(ids.ge(rows.shape[0]));
  if (rows.shape[0] == 0) {  // an empty shard (more ranks than rows left)
    std::vector<int64_t> shape = ids.sizes().vec();
    shape.push_back(weight.size(1));
    torch::jit::drop(st, 5);
    st.emplace_back(at::zeros(shape, weight.options()));
    return;
  }
  st[base + 1] = ids.masked_fill(outside, 0);
  op.callBoxed(st);
  st.back().toTensor().masked_fill_(outside.unsqueeze(-1), 0);  // the lookup's own memory
}

// embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
Decision embedding(const OpCall& call) {
  const DTensorSpec& weight = call.input(0);
  const DTensorSpec& indices = call.input(1);
  const int64_t out_last = indices.ndim();
  // PyTorch's rowwise indices are a mask placement that a shard cannot move to (infinite
  // cost); keep its choices by leaving rowwise out where the indices arrive sharded.
  std::vector<std::vector<DimStrategy>> choices(call.mesh_ndim());
  for (int64_t m = 0; m < call.mesh_ndim(); ++m) {
    auto& c = choices[m];
    c = {choice(Replicate(), Replicate(), Replicate()),
         choice(Shard(out_last), Shard(1), Replicate())};
    if (!indices.placements()[m].is_shard()) c.push_back(choice(Partial(), Shard(0), Replicate()));
    for (int64_t d = 0; d < indices.ndim(); ++d) {
      c.push_back(choice(Shard(d), Replicate(), Shard(d)));
    }
  }
  Decision d = dispatch::choose(call, expand_to_mesh(call, choices, 1));
  // Rows split over one rank are all the rows: the plain lookup, no masking.
  const auto& wp = d.inputs[0];
  for (int64_t m = 0; m < call.mesh_ndim(); ++m) {
    if (wp[m].is_shard(0) && call.mesh().size(m) > 1) d.local_kernel = masked_lookup;
  }
  std::vector<int64_t> shape = indices.shape();
  shape.push_back(weight.shape().at(1));
  d.output_meta = {contiguous_meta(shape, weight.dtype())};
  return d;
}

// embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
// Candidates [grad_weight | grad_output, indices]: all Replicate; colwise [Shard(1) |
// Shard(last), R]; per index dim [Partial | Shard(d), Shard(d)]; [Partial | Partial, R].
Decision embedding_backward(const OpCall& call) {
  const DTensorSpec& grad = call.input(0);
  const DTensorSpec& indices = call.input(1);
  std::vector<DimStrategy> choices{choice(Replicate(), Replicate(), Replicate()),
                                   choice(Shard(1), Shard(grad.ndim() - 1), Replicate())};
  // scale_grad_by_freq divides by how often each id occurs in the whole batch: a shard of the
  // indices would count only its own ids.
  if (!call.bool_arg(4)) {
    for (int64_t d = 0; d < indices.ndim(); ++d) {
      choices.push_back(choice(Partial(), Shard(d), Shard(d)));
    }
  }
  choices.push_back(choice(Partial(), Partial(), Replicate()));
  Decision d = dispatch::choose(call, expand_to_mesh(call, choices, 1));
  d.output_meta = {contiguous_meta({call.int_arg(2), grad.shape().back()}, grad.dtype())};
  return d;
}

}  // namespace

DTENSOR_RULES(embedding_ops) {
  using dispatch::register_rule;
  register_rule("aten::embedding", embedding);
  register_rule("aten::embedding_dense_backward", embedding_backward);
}

}  // namespace dtensor::ops
