// The decoder built on the meta device and given only each rank's local parameters.
#include "dtensor/models/meta_init.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"
#include "meta_construction.h"

namespace dtensor::models {

namespace detail {

namespace {
thread_local MetaConstructionGuard* innermost = nullptr;
}  // namespace

MetaConstructionGuard::MetaConstructionGuard()
    : outer_(c10::impl::tls_local_dispatch_key_set()), previous_(innermost) {
  // The Meta backend outranks the CPU in dispatch, so an operator on a (meta) tensor runs the
  // meta kernel. Factories (empty, ones) take no tensor: BackendSelect would pick their backend
  // from the requested device; without it the included Meta key decides for them too.
  c10::impl::LocalDispatchKeySet meta = outer_;
  meta.included_ = meta.included_.add(c10::DispatchKey::Meta);
  meta.excluded_ = meta.excluded_.add(c10::DispatchKey::BackendSelect);
  c10::impl::_force_tls_local_dispatch_key_set(meta);
  innermost = this;
}

MetaConstructionGuard::~MetaConstructionGuard() {
  c10::impl::_force_tls_local_dispatch_key_set(outer_);
  innermost = previous_;
}

bool MetaConstructionGuard::active() { return innermost != nullptr; }

MetaConstructionGuard::Suspend::Suspend() : suspended_(innermost) {
  if (suspended_ == nullptr) return;
  restore_.emplace(suspended_->outer_);
  innermost = suspended_->previous_;
}

MetaConstructionGuard::Suspend::~Suspend() {
  if (suspended_ != nullptr) innermost = suspended_;
}

void materialize_parameters(torch::nn::Module& root, const MakeLocal& make) {
  at::NoGradGuard no_grad;
  for (const auto& item : root.named_modules()) {
    torch::nn::Module& module = *item.value();
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& p : module.named_parameters(/*recurse=*/false)) {
      const at::Tensor& param = p.value();
      const bool distributed = is_dtensor(param);
      const at::Tensor local = distributed ? local_tensor(param) : param;
      if (!local.is_meta()) continue;
      const std::string name = prefix + p.key();
      const c10::Device device = distributed ? spec_of(param).mesh().device() : c10::kCPU;
      at::Tensor value = make(name, local, device);
      TORCH_CHECK(value.defined() && !value.is_meta() && value.sizes() == local.sizes() &&
                      value.scalar_type() == local.scalar_type(),
                  "materializing parameter \"", name, "\": expected a ", local.scalar_type(),
                  " tensor of shape ", local.sizes(), " with storage, got ",
                  value.defined() ? value.toString() : "an undefined tensor", " of shape ",
                  value.defined() ? value.sizes() : c10::IntArrayRef{});
      replace_parameter(module, p.key(),
                        distributed ? make_dtensor(value, dtensor_impl(param)->spec()) : value);
    }
  }
}

void materialize_parameters(TransformerImpl& model, const MakeLocal& make) {
  materialize_parameters(static_cast<torch::nn::Module&>(model), make);
  if (model.config().tie_embeddings) model.tie_output_to_embedding();
}

}  // namespace detail

Transformer meta_transformer(const DecoderConfig& config) {
  detail::MetaConstructionGuard meta;
  return Transformer(config);
}

Transformer empty_transformer(const DecoderConfig& config, c10::ScalarType dtype,
                              const std::optional<DeviceMesh>& mesh,
                              const TensorParallelOptions& tp) {
  Transformer model = meta_transformer(config);
  model->to(dtype);
  // On meta tensors the plan only records shapes and placements: no communication, whatever
  // src_data_rank says.
  if (mesh) apply_tensor_parallel(*model, *mesh, tp);
  detail::materialize_parameters(
      *model, [](const std::string&, const at::Tensor& local, c10::Device device) {
        return at::empty(local.sizes(), local.options().device(device));
      });
  return model;
}

}  // namespace dtensor::models
