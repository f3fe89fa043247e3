#pragma once
// A DTensor is an ordinary at::Tensor whose TensorImpl is DTensorImpl: it holds the local shard (a
// plain tensor without autograd) and an immutable DTensorSpec, reports the global sizes/strides and
// the local device, and dispatches on a backend key (PrivateUse1 by default) with autograd above
// it. See docs/ARCHITECTURE.md, "A DTensor is an at::Tensor".
#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <optional>

#include "dtensor/comm/collectives.h"
#include "dtensor/core/dtensor_spec.h"

namespace dtensor {

/// The backend key DTensors carry (configured at build time: DTENSOR_DISPATCH_KEY).
c10::DispatchKey dtensor_dispatch_key();

/// The TensorImpl of a DTensor: local shard, spec, and an optional pending async collective.
class DTensorImpl final : public c10::TensorImpl {
 public:
  /// Wraps `local` (a plain tensor) with `spec`; reports the spec's global sizes and strides.
  DTensorImpl(at::Tensor local, SpecPtr spec);

  /// The local shard. Waits for a pending async collective first.
  const at::Tensor& local() const {
    if (C10_UNLIKELY(pending_.has_value())) wait_pending();
    return local_;
  }
  const SpecPtr& spec() const { return spec_; }  ///< The layout (mesh, placements, global meta).
  /// Whether an async collective is in flight.
  bool has_pending() const { return pending_.has_value(); }
  /// Makes local() wait for `p` first.
  void set_pending(comm::PendingResult p) { pending_ = std::move(p); }

  /// Replaces local shard and spec in place (in-place ops whose metadata changes).
  void replace(at::Tensor local, SpecPtr spec);

  /// TensorImpl override (detach): a new DTensorImpl sharing the local shard (waited on) and spec.
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter,
      bool allow_tensor_metadata_change) const override;
  /// Same, taking the version counter by rvalue.
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const override;
  /// Takes another DTensorImpl's local shard and spec (`.data = ...`); throws for plain tensors.
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;
  /// Drops the local shard (and a pending collective) when the last strong reference goes: a
  /// weak reference keeps the TensorImpl object, and must not keep the shard's memory with it.
  void release_resources() override;

 private:
  const char* tensorimpl_type_name() const override { return "DTensorImpl"; }
  void set_global_meta();
  void wait_pending() const;
  template <typename VC>
  c10::intrusive_ptr<c10::TensorImpl> copy_and_detach(VC&& vc, bool allow_change) const;

  mutable at::Tensor local_;
  SpecPtr spec_;
  mutable std::optional<comm::PendingResult> pending_;
};

/// Fast test used on the hot path: the tensor carries our key and is a DTensorImpl.
inline bool is_dtensor(const at::Tensor& t) {
  return t.defined() && t.unsafeGetTensorImpl()->key_set().has(dtensor_dispatch_key());
}
/// The DTensorImpl of `t`, unchecked: only for tensors where is_dtensor(t) is true.
inline DTensorImpl* dtensor_impl(const at::Tensor& t) {
  return static_cast<DTensorImpl*>(t.unsafeGetTensorImpl());
}

/// Wraps a local shard (no autograd recorded) with a spec.
at::Tensor make_dtensor(at::Tensor local, SpecPtr spec);

/// Accessors that mirror PyTorch's DTensor attributes. They throw for plain tensors.
const DTensorSpec& spec_of(const at::Tensor& t);
const DeviceMesh& device_mesh(const at::Tensor& t);
const Placements& placements(const at::Tensor& t);
/// The raw local shard (no autograd connection; to_local() is the differentiable one).
at::Tensor local_tensor(const at::Tensor& t);
/// True while an async redistribute's collective has not been waited on.
bool is_pending(const at::Tensor& t);

}  // namespace dtensor
