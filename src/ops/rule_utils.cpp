#include "dtensor/ops/rule_utils.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/ones.h>

namespace dtensor::ops {

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
  call.op().callBoxed(st);
  return st.at(ret).toTensor().scalar_type();
}

}  // namespace dtensor::ops
