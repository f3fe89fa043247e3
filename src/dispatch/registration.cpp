// Installs the kernel: a backend fallback for our key, plus a direct registration on every op that
// has a CompositeExplicitAutograd(NonFunctional) kernel, because those kernels would otherwise run
// on the wrapper before any fallback, and on the few CompositeImplicitAutograd backward ops whose
// decomposition writes into a plain global-size zeros tensor; the other CompositeImplicitAutograd
// ops get composite_kernel on our autograd key, which names them when their decomposition reads
// a DTensor's memory (docs/ARCHITECTURE.md, "Why composite ops are routed to our kernel").
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_to_copy_compositeexplicitautograd_dispatch.h>
#include <torch/library.h>

#include <map>
#include <memory>

#include "dispatch_key.h"  // generated: DTENSOR_KEY_<key>
#include "dtensor/core/dtensor_impl.h"
#include "kernel.h"

namespace dtensor::dispatch {
namespace {

void boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) { dtensor_kernel(op, stack); }

// CompositeImplicitAutograd backward ops that build at::zeros(sizes, grad.options()) (a plain
// tensor) and scatter the DTensor gradient into it in place: decomposed above us, the in-place
// op would hand back the plain tensor, so the leaf's gradient would lose its DTensor. Routed to
// the kernel, a rule decides their layout and the decomposition runs on local shards.
constexpr const char* kImplicitOpsBuildingPlainZeros[] = {
    "aten::value_selecting_reduction_backward",  // max/min.dim, sort, topk, kthvalue, mode, ...
};

bool builds_plain_zeros(const std::string& name) {
  for (const char* n : kImplicitOpsBuildingPlainZeros) {
    if (name == n) return true;
  }
  return false;
}

void composite(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  composite_kernel(op, ks, stack);
}

int route_composite_ops() {
  auto& d = c10::Dispatcher::singleton();
  const c10::DispatchKey key = dtensor_dispatch_key();
  const c10::DispatchKey autograd_key =
      c10::getAutogradKeyFromBackend(c10::toBackendComponent(key));
  // One IMPL library per (namespace, key); kept for the life of the process.
  static std::map<std::pair<std::string, c10::DispatchKey>, std::unique_ptr<torch::Library>> libs;
  int n = 0;
  for (const auto& name : d.getAllOpNames()) {
    auto op = d.findOp(name);
    if (!op) continue;
    const bool explicit_composite =
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
        builds_plain_zeros(name.name);
    // Decomposed above our key: its kernel on our autograd key names the op if the
    // decomposition reads a DTensor's memory.
    const bool implicit_composite =
        !explicit_composite &&
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::Autograd) &&
        !op->hasKernelForDispatchKey(autograd_key);
    if (!(explicit_composite || implicit_composite) || op->hasKernelForDispatchKey(key)) continue;
    const std::string& full = name.name;
    const auto sep = full.find("::");
    if (sep == std::string::npos) continue;
    const std::string ns = full.substr(0, sep);
    const c10::DispatchKey on = explicit_composite ? key : autograd_key;
    auto& lib = libs[{ns, on}];
    if (!lib) {
      lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, on, __FILE__, __LINE__);
    }
    const std::string op_name = name.overload_name.empty()
                                    ? full.substr(sep + 2)
                                    : full.substr(sep + 2) + "." + name.overload_name;
    if (explicit_composite) {
      lib->impl(op_name.c_str(), torch::CppFunction::makeFromBoxedFunction<&boxed>());
      ++n;
    } else {
      lib->impl(op_name.c_str(), torch::CppFunction::makeFromBoxedFunction<&composite>());
    }
  }
  return n;
}

// A copy to another dtype with `device=meta` spelled out (x.type_as(other), x.to(other.options()),
// as at::rms_norm rounds its float32 result back to bfloat16) of a DTensor whose shards are meta
// tensors (dtensor_plan): the device argument adds the Meta backend to the op's dispatch keys, and
// Meta ranks above our key, so LibTorch's own kernel would copy the wrapper as a plain tensor of
// the global size. This Meta kernel hands DTensors on to ours and plain tensors to LibTorch's.
at::Tensor meta_to_copy(c10::DispatchKeySet, const at::Tensor& self,
                        std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                        std::optional<at::Device> device, std::optional<bool> pin_memory,
                        bool non_blocking, std::optional<at::MemoryFormat> memory_format) {
  const c10::DispatchKey key = dtensor_dispatch_key();
  if (!self.key_set().has(key)) {
    return at::compositeexplicitautograd::_to_copy(self, dtype, layout, device, pin_memory,
                                                   non_blocking, memory_format);
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("aten::_to_copy", "")
          .typed<at::Tensor(const at::Tensor&, std::optional<at::ScalarType>,
                            std::optional<at::Layout>, std::optional<at::Device>,
                            std::optional<bool>, bool, std::optional<at::MemoryFormat>)>();
  return op.redispatch(c10::DispatchKeySet(key), self, dtype, layout, device, pin_memory,
                       non_blocking, memory_format);
}

}  // namespace

int registered_composite_ops() {
  static const int n = route_composite_ops();
  return n;
}

}  // namespace dtensor::dispatch

#if defined(DTENSOR_KEY_PRIVATEUSE2)
TORCH_LIBRARY_IMPL(_, PrivateUse2, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&dtensor::dispatch::boxed>());
}
TORCH_LIBRARY_IMPL(_, AutogradPrivateUse2, m) { m.fallback(torch::CppFunction::makeFallthrough()); }
#elif defined(DTENSOR_KEY_PRIVATEUSE3)
TORCH_LIBRARY_IMPL(_, PrivateUse3, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&dtensor::dispatch::boxed>());
}
TORCH_LIBRARY_IMPL(_, AutogradPrivateUse3, m) { m.fallback(torch::CppFunction::makeFallthrough()); }
#else
TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&dtensor::dispatch::boxed>());
}
#endif

TORCH_LIBRARY_IMPL(aten, Meta, m) { m.impl("_to_copy", TORCH_FN(dtensor::dispatch::meta_to_copy)); }

namespace {
// Route composite ops when the library loads (after LibTorch registered its operators).
const int dtensor_routed_ops = dtensor::dispatch::registered_composite_ops();
}  // namespace
