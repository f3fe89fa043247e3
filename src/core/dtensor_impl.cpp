#include "dtensor/core/dtensor_impl.h"

#include <c10/util/Exception.h>

#include "dispatch_key.h"  // generated: DTENSOR_KEY_<key>

namespace dtensor {

c10::DispatchKey dtensor_dispatch_key() {
#if defined(DTENSOR_KEY_PRIVATEUSE2)
  return c10::DispatchKey::PrivateUse2;
#elif defined(DTENSOR_KEY_PRIVATEUSE3)
  return c10::DispatchKey::PrivateUse3;
#else
  return c10::DispatchKey::PrivateUse1;
#endif
}

DTensorImpl::DTensorImpl(at::Tensor local, SpecPtr spec)
    : c10::TensorImpl(c10::DispatchKeySet(dtensor_dispatch_key()), local.dtype(), local.device()),
      local_(std::move(local)),
      spec_(std::move(spec)) {
  set_storage_access_should_throw();
  set_global_meta();
}

void DTensorImpl::set_global_meta() {
  const auto& m = spec_->meta();
  set_sizes_and_strides(m.shape, m.stride);
  // dtype follows the local shard (they only differ transiently inside the kernel).
  data_type_ = local_.dtype();
}

void DTensorImpl::replace(at::Tensor local, SpecPtr spec) {
  local_ = std::move(local);
  spec_ = std::move(spec);
  pending_.reset();
  set_global_meta();
}

void DTensorImpl::release_resources() {
  if (pending_) {
    try {
      pending_->wait();  // nobody reads it, but the collective must not be left in flight
    } catch (...) {
      // The collective failed; whoever waits on its group reports it.
    }
  }
  pending_.reset();
  local_ = at::Tensor();
  c10::TensorImpl::release_resources();
}

void DTensorImpl::wait_pending() const {
  auto p = std::move(*pending_);
  pending_.reset();
  local_ = p.wait();
}

template <typename VC>
c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::copy_and_detach(VC&& vc, bool allow_change) const {
  auto impl = c10::make_intrusive<DTensorImpl>(local(), spec_);
  copy_tensor_metadata(this, impl.get(), std::forward<VC>(vc), allow_change);
  impl->refresh_numel();
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  return copy_and_detach(version_counter, allow_tensor_metadata_change);
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  return copy_and_detach(std::move(version_counter), allow_tensor_metadata_change);
}

void DTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  TORCH_CHECK(impl->key_set().has(dtensor_dispatch_key()),
              "dtensor: cannot assign a plain tensor's data to a DTensor (set_data / .data = "
              "...); build a DTensor with distribute_tensor or from_local instead");
  auto* other = static_cast<DTensorImpl*>(impl.get());
  copy_tensor_metadata(other, this, version_counter(), allow_tensor_metadata_change());
  local_ = other->local();
  spec_ = other->spec_;
  refresh_numel();
}

at::Tensor make_dtensor(at::Tensor local, SpecPtr spec) {
  return at::Tensor(c10::make_intrusive<DTensorImpl>(std::move(local), std::move(spec)));
}

static DTensorImpl* checked_impl(const at::Tensor& t, const char* what) {
  TORCH_CHECK(is_dtensor(t), "dtensor: ", what, " needs a DTensor, got a plain tensor");
  return dtensor_impl(t);
}

const DTensorSpec& spec_of(const at::Tensor& t) { return *checked_impl(t, "spec_of")->spec(); }
const DeviceMesh& device_mesh(const at::Tensor& t) {
  return checked_impl(t, "device_mesh")->spec()->mesh();
}
const Placements& placements(const at::Tensor& t) {
  return checked_impl(t, "placements")->spec()->placements();
}
at::Tensor local_tensor(const at::Tensor& t) { return checked_impl(t, "local_tensor")->local(); }
bool is_pending(const at::Tensor& t) { return checked_impl(t, "is_pending")->has_pending(); }

}  // namespace dtensor
