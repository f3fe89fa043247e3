// Comparisons of whole tensors: equal, is_same_size.
#include <ATen/ops/equal.h>
#include <ATen/ops/scalar_tensor.h>

#include "dtensor/ops/kernel_collectives.h"
#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

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
      flag = kernel_all_reduce("aten::equal", flag, ReduceOp::Min, mesh, sharded);
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

DTENSOR_RULES(compare_ops) {
  using dispatch::register_rule;
  register_rule("aten::equal", equal);
  register_rule("aten::is_same_size", is_same_size);
}

}  // namespace dtensor::ops
