#include "dtensor/core/distribute_module.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <mutex>
#include <unordered_set>

#include "dtensor/core/api.h"

namespace dtensor {
namespace {

using Registry = torch::OrderedDict<std::string, at::Tensor>;

// Module has no API to replace a registered parameter or buffer. Explicit instantiation may
// name private members, which lets us take pointers to the two registries here, once.
Registry torch::nn::Module::*buffers_member();
template <Registry torch::nn::Module::*M>
struct BuffersAccess {
  friend Registry torch::nn::Module::*buffers_member() { return M; }
};
template struct BuffersAccess<&torch::nn::Module::buffers_>;

struct RegistryAccess : torch::nn::Module {
  static Registry& params(torch::nn::Module& m) { return m.*(&RegistryAccess::parameters_); }
  static Registry& buffers(torch::nn::Module& m) { return m.*buffers_member(); }
};

template <typename Impl>
bool set_member(torch::nn::Module& m, const std::string& name, const at::Tensor& v) {
  auto* impl = dynamic_cast<Impl*>(&m);
  if (!impl) return false;
  if (name == "weight") {
    impl->weight = v;
    return true;
  }
  if constexpr (requires { impl->bias; }) {
    if (name == "bias") {
      impl->bias = v;
      return true;
    }
  }
  return false;
}

template <typename Impl>
bool set_norm_buffer(torch::nn::Module& m, const std::string& name, const at::Tensor& v) {
  auto* impl = dynamic_cast<Impl*>(&m);
  if (!impl) return false;
  if (name == "running_mean") impl->running_mean = v;
  else if (name == "running_var") impl->running_var = v;
  else if (name == "num_batches_tracked") impl->num_batches_tracked = v;
  else return false;
  return true;
}

void update_member(torch::nn::Module& m, const std::string& name, const at::Tensor& v) {
  if (auto* t = dynamic_cast<ParameterSwapTarget*>(&m)) {
    t->on_parameter_replaced(name, v);
    return;
  }
  set_member<torch::nn::LinearImpl>(m, name, v) || set_member<torch::nn::EmbeddingImpl>(m, name, v) ||
      set_member<torch::nn::LayerNormImpl>(m, name, v) ||
      set_member<torch::nn::GroupNormImpl>(m, name, v) ||
      set_member<torch::nn::Conv1dImpl>(m, name, v) || set_member<torch::nn::Conv2dImpl>(m, name, v) ||
      set_member<torch::nn::Conv3dImpl>(m, name, v) ||
      set_member<torch::nn::BatchNorm1dImpl>(m, name, v) ||
      set_member<torch::nn::BatchNorm2dImpl>(m, name, v) ||
      set_member<torch::nn::BatchNorm3dImpl>(m, name, v) ||
      set_norm_buffer<torch::nn::BatchNorm1dImpl>(m, name, v) ||
      set_norm_buffer<torch::nn::BatchNorm2dImpl>(m, name, v) ||
      set_norm_buffer<torch::nn::BatchNorm3dImpl>(m, name, v);
}

std::mutex& applied_mu() {
  static std::mutex m;
  return m;
}
std::unordered_set<const torch::nn::Module*>& applied() {
  static std::unordered_set<const torch::nn::Module*> s;
  return s;
}

}  // namespace

void replace_parameter(torch::nn::Module& module, const std::string& name, at::Tensor value) {
  auto& reg = RegistryAccess::params(module);
  at::Tensor* slot = reg.find(name);
  TORCH_CHECK(slot, "dtensor: module ", module.name(), " has no parameter '", name,
              "' (it has: ", c10::Join(", ", reg.keys()), ")");
  const bool rg = slot->requires_grad();
  if (value.requires_grad() != rg) value.set_requires_grad(rg);
  *slot = value;
  update_member(module, name, value);
}

void replace_buffer(torch::nn::Module& module, const std::string& name, at::Tensor value) {
  auto& reg = RegistryAccess::buffers(module);
  at::Tensor* slot = reg.find(name);
  TORCH_CHECK(slot, "dtensor: module ", module.name(), " has no buffer '", name, "'");
  *slot = value;
  update_member(module, name, value);
}

void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const PartitionFn& partition_fn) {
  {
    std::lock_guard<std::mutex> l(applied_mu());
    TORCH_CHECK(applied().insert(&module).second,
                "distribute_module should only be called once on a module, but it has already "
                "been called on ", module.name(), "!");
  }
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    torch::nn::Module& sub = *item.value();
    if (partition_fn) partition_fn(item.key(), sub, mesh);
    const Placements rep = replicate_all(mesh.ndim());
    for (const auto& p : sub.named_parameters(/*recurse=*/false)) {
      if (is_dtensor(p.value())) continue;
      replace_parameter(sub, p.key(), distribute_tensor(p.value().detach(), mesh, rep));
    }
    for (const auto& b : sub.named_buffers(/*recurse=*/false)) {
      if (!b.value().defined() || is_dtensor(b.value())) continue;
      replace_buffer(sub, b.key(), distribute_tensor(b.value().detach(), mesh, rep));
    }
  }
}

}  // namespace dtensor
