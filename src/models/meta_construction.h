#pragma once
// Building the decoder without parameter memory: modules constructed on the meta device, then each
// rank's local parameters allocated (or handed over from a checkpoint reader) after the TP plan
// has cut them, so no rank ever holds the whole model.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <functional>
#include <optional>
#include <string>

#include "dtensor/models/transformer.h"

namespace dtensor::models::detail {

// While alive on this thread, every new tensor is a meta tensor (shape and dtype, no storage),
// whatever device the code asks for, as under PyTorch's `with torch.device("meta")`: LibTorch's
// layers allocate their weights on the CPU unconditionally, and this makes their constructors
// allocate nothing. Only operators with meta kernels may run under it (empty, ones, uniform_,
// normal_, fill_: what the layers' constructors use). TransformerImpl's constructor sees it
// (active()), skips its initialisation and builds its rotary table outside it (Suspend).
class MetaConstructionGuard {
 public:
  MetaConstructionGuard();
  ~MetaConstructionGuard();
  MetaConstructionGuard(const MetaConstructionGuard&) = delete;
  MetaConstructionGuard& operator=(const MetaConstructionGuard&) = delete;

  // Whether a guard is alive (and not suspended) on this thread.
  static bool active();

  // While alive, tensors are ordinary again: the dispatch state from before the innermost guard.
  class Suspend {
   public:
    Suspend();
    ~Suspend();
    Suspend(const Suspend&) = delete;
    Suspend& operator=(const Suspend&) = delete;

   private:
    MetaConstructionGuard* suspended_;
    std::optional<c10::impl::ForceDispatchKeyGuard> restore_;
  };

 private:
  c10::impl::LocalDispatchKeySet outer_;  // the thread's dispatch state before this guard
  MetaConstructionGuard* previous_;       // the enclosing guard, if any
};

// Returns the tensor that replaces the meta `local` part of parameter `name` (our name): the same
// shape and dtype, on `device` (the mesh's for a DTensor parameter, else the CPU).
using MakeLocal =
    std::function<at::Tensor(const std::string& name, const at::Tensor& local, c10::Device device)>;

// Replaces every parameter of `module` whose local part is a meta tensor by make(...) (a
// DTensor's local shard keeps its spec). Throws when make returns a tensor of another shape or
// dtype, or a meta tensor.
void materialize_parameters(torch::nn::Module& module, const MakeLocal& make);
// The same for the whole model; its tied output head then points at the new embedding weight.
void materialize_parameters(TransformerImpl& model, const MakeLocal& make);

}  // namespace dtensor::models::detail
