#pragma once
// What fully_shard and replicate share: the registry of their units, by module, through which
// set_requires_gradient_sync (dtensor/fsdp/fully_shard.h) turns a module's gradient
// synchronisation off and on, and a walk over the tensors of a unit's output.
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>

#include <memory>
#include <mutex>

namespace dtensor::fsdp::detail {

// Whether a unit's backward synchronises its gradients over dp; each kind of unit keeps what it
// defers beside it (FSDP: the summed unsharded gradients; replicate: nothing, .grad accumulates).
struct GradientSync {
  std::mutex mu;
  bool requires_sync = true;
};

// Lists `unit` for set_requires_gradient_sync, as long as both it and `sync` live.
void register_sync_unit(const torch::nn::Module& unit, const std::shared_ptr<GradientSync>& sync);

// f(t) for every tensor in `v` (a tensor, or tuples and lists of them).
template <typename F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) for_each_tensor(e, f);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) for_each_tensor(e, f);
  }
}

}  // namespace dtensor::fsdp::detail
