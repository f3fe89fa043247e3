#include "dtensor/core/distribute_module.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <memory>
#include <mutex>
#include <unordered_map>
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
  if (name == "running_mean")
    impl->running_mean = v;
  else if (name == "running_var")
    impl->running_var = v;
  else if (name == "num_batches_tracked")
    impl->num_batches_tracked = v;
  else
    return false;
  return true;
}

void update_member(torch::nn::Module& m, const std::string& name, const at::Tensor& v) {
  if (auto* t = dynamic_cast<ParameterSwapTarget*>(&m)) {
    t->on_parameter_replaced(name, v);
    return;
  }
  set_member<torch::nn::LinearImpl>(m, name, v) ||
      set_member<torch::nn::EmbeddingImpl>(m, name, v) ||
      set_member<torch::nn::LayerNormImpl>(m, name, v) ||
      set_member<torch::nn::GroupNormImpl>(m, name, v) ||
      set_member<torch::nn::Conv1dImpl>(m, name, v) ||
      set_member<torch::nn::Conv2dImpl>(m, name, v) ||
      set_member<torch::nn::Conv3dImpl>(m, name, v) ||
      set_member<torch::nn::BatchNorm1dImpl>(m, name, v) ||
      set_member<torch::nn::BatchNorm2dImpl>(m, name, v) ||
      set_member<torch::nn::BatchNorm3dImpl>(m, name, v) ||
      set_norm_buffer<torch::nn::BatchNorm1dImpl>(m, name, v) ||
      set_norm_buffer<torch::nn::BatchNorm2dImpl>(m, name, v) ||
      set_norm_buffer<torch::nn::BatchNorm3dImpl>(m, name, v);
}

// Modules distribute_module has been applied to. Keyed by address, with a weak reference to
// tell a live module from a later one at a reused address (modules owned by a shared_ptr; a
// module on the stack has no owner and is matched by address alone).
struct AppliedEntry {
  std::weak_ptr<const torch::nn::Module> owner;
  bool owned = false;
};
std::mutex& applied_mu() {
  static std::mutex m;
  return m;
}
std::unordered_map<const torch::nn::Module*, AppliedEntry>& applied() {
  static std::unordered_map<const torch::nn::Module*, AppliedEntry> s;
  return s;
}
bool is_applied_locked(const torch::nn::Module& module) {
  auto it = applied().find(&module);
  if (it == applied().end()) return false;
  if (it->second.owned && it->second.owner.expired()) {
    applied().erase(it);  // that module is gone; this is a new one at the same address
    return false;
  }
  return true;
}

// Root first (as ""), then every submodule; the root need not be owned by a shared_ptr.
template <typename F>
void for_each_module(torch::nn::Module& root, F&& f) {
  f(std::string(), root);
  for (const auto& item : root.named_modules("", /*include_self=*/false))
    f(item.key(), *item.value());
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

torch::OrderedDict<std::string, at::Tensor> unique_named_parameters(const torch::nn::Module& module,
                                                                    bool recurse) {
  torch::OrderedDict<std::string, at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.named_parameters(recurse))
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) out.insert(p.key(), p.value());
  return out;
}

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module, bool recurse) {
  return unique_named_parameters(module, recurse).values();
}

void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const PartitionFn& partition_fn, std::optional<int64_t> src_data_rank) {
  {
    std::lock_guard<std::mutex> l(applied_mu());
    TORCH_CHECK(!is_applied_locked(module),
                "distribute_module should only be called once on a module, but it has already "
                "been called on ",
                module.name(), "!");
  }
  const Placements rep = replicate_all(mesh.ndim());
  for_each_module(module, [&](const std::string& name, torch::nn::Module& sub) {
    if (partition_fn) partition_fn(name, sub, mesh);
    for (const auto& p : sub.named_parameters(/*recurse=*/false)) {
      if (!p.value().defined() || is_dtensor(p.value())) continue;
      replace_parameter(sub, p.key(),
                        distribute_tensor(p.value().detach(), mesh, rep, src_data_rank));
    }
    for (const auto& b : sub.named_buffers(/*recurse=*/false)) {
      if (!b.value().defined() || is_dtensor(b.value())) continue;
      replace_buffer(sub, b.key(), distribute_tensor(b.value().detach(), mesh, rep, src_data_rank));
    }
  });
  // Marked once done, as PyTorch sets its flag: a failed call can be retried after a rollback.
  std::weak_ptr<const torch::nn::Module> owner = module.weak_from_this();
  const bool owned = !owner.expired();
  std::lock_guard<std::mutex> l(applied_mu());
  applied()[&module] = AppliedEntry{std::move(owner), owned};
}

bool is_distributed_module(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> l(applied_mu());
  return is_applied_locked(module);
}

void forget_distributed_module(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> l(applied_mu());
  applied().erase(&module);
}

}  // namespace dtensor
