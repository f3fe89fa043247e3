#include "dtensor/ops/rule_utils.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/ones.h>
#include <ATen/record_function.h>

namespace dtensor::ops {
namespace {

// Whether no dim of input `i` is split into more shards than it has elements under `p`.
bool shardable(const OpCall& call, size_t i, c10::ArrayRef<Placement> p) {
  const SpecPtr& spec = call.inputs()[i].spec;
  if (!spec) return true;  // an undefined optional tensor
  const auto& shape = spec->shape();
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t n = shards_of_dim(call.mesh(), p, static_cast<int64_t>(d));
    if (n > 1 && shape[d] < n) return false;
  }
  return true;
}

}  // namespace

std::vector<Strategy> expand_to_mesh(const OpCall& call,
                                     const std::vector<std::vector<DimStrategy>>& choices,
                                     size_t num_outputs, const StrategyFilter& keep,
                                     bool drop_unshardable) {
  const auto mesh_nd = static_cast<int64_t>(choices.size());
  TORCH_INTERNAL_ASSERT(mesh_nd == call.mesh_ndim(), call.name(), ": ", mesh_nd,
                        " lists of choices for a ", call.mesh_ndim(), "-D mesh");
  std::vector<Strategy> out;
  if (std::any_of(choices.begin(), choices.end(), [](const auto& c) { return c.empty(); })) {
    return out;
  }
  const size_t width = choices[0][0].size();
  TORCH_INTERNAL_ASSERT(width >= num_outputs, call.name(), ": a DimStrategy of ", width,
                        " placements for ", num_outputs, " outputs");
  std::vector<size_t> pick(mesh_nd, 0);  // mixed-radix counter, mesh dim 0 slowest
  while (true) {
    Strategy s;
    s.outputs.resize(num_outputs);
    s.inputs.resize(width - num_outputs);
    for (int64_t m = 0; m < mesh_nd; ++m) {
      const DimStrategy& c = choices[m][pick[m]];
      TORCH_INTERNAL_ASSERT(c.size() == width, call.name(), ": DimStrategies of different sizes");
      for (size_t k = 0; k < num_outputs; ++k) s.outputs[k].push_back(c[k]);
      for (size_t i = 0; i < s.inputs.size(); ++i) s.inputs[i].push_back(c[num_outputs + i]);
    }
    bool ok = true;
    for (size_t i = 0; i < s.inputs.size() && ok && drop_unshardable; ++i) {
      ok = shardable(call, i, s.inputs[i]);
    }
    if (ok && (!keep || keep(s))) out.push_back(std::move(s));
    int64_t m = mesh_nd - 1;
    while (m >= 0 && ++pick[m] == choices[m].size()) pick[m--] = 0;
    if (m < 0) break;
  }
  return out;
}

std::vector<Strategy> expand_to_mesh(const OpCall& call, const std::vector<DimStrategy>& choices,
                                     size_t num_outputs, const StrategyFilter& keep) {
  return expand_to_mesh(call, std::vector<std::vector<DimStrategy>>(call.mesh_ndim(), choices),
                        num_outputs, keep);
}

at::ScalarType proxy_result_dtype(const OpCall& call, size_t ret) {
  torch::jit::Stack st(call.args().begin(), call.args().end());
  auto proxy = [&](size_t i) {
    const auto& sp = call.input(i);
    return at::ones(std::vector<int64_t>(sp.ndim(), 1), at::TensorOptions().dtype(sp.dtype()));
  };
  for (size_t i = 0; i < call.num_inputs(); ++i) {
    const auto& in = call.inputs()[i];
    if (!in.spec) continue;
    if (in.list_index < 0) {
      st[in.arg] = proxy(i);
    } else if (st[in.arg].isTensorList()) {
      auto l = st[in.arg].toTensorList().copy();
      l.set(in.list_index, proxy(i));
      st[in.arg] = l;
    } else {
      auto l = st[in.arg].toList().copy();
      l.set(in.list_index, proxy(i));
      st[in.arg] = l;
    }
  }
  for (auto& v : st) {
    if (v.isDevice()) v = c10::IValue(c10::Device(c10::kCPU));
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  at::DisableRecordFunctionGuard not_work;  // dtype inference: invisible to profilers
  call.op().callBoxed(st);
  return st.at(ret).toTensor().scalar_type();
}

}  // namespace dtensor::ops
