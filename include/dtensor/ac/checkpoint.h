#pragma once
// Activation checkpointing for hook-capable modules (docs/ARCHITECTURE.md, "Activation
// checkpointing"). A checkpointed module's forward keeps no activations: its body runs without
// building an autograd graph and only its inputs are saved. In backward the body runs again
// with grad enabled, on the saved inputs, and is backpropagated; gradients reach the module's
// parameters (DTensors too) through the autograd engine, so they accumulate into the same
// .grad as without checkpointing.
//
// The recompute gives the same values as the forward: it replays the forward's random numbers
// (the CPU generator, the CUDA one of the inputs' device, and DTensor's stream, so dropout
// masks are identical), and by default it never communicates: the results of every collective
// the forward issued are recorded (dtensor/comm/collective_tape.h) and handed back in order. A
// recompute whose collectives differ (type, shape, group) throws naming the module. So
// checkpointing adds no collective to a step; it costs one extra forward of the module, and
// keeps the collectives' results (torchtitan's selective policy keeps them too, for the same
// reason). With replay_collectives = false the recompute issues them again instead, as
// PyTorch's checkpoint does: less memory, more communication in backward.
//
//   auto block = MyBlock(...);                 // a dtensor::nn::Module with forward(x)
//   dtensor::ac::checkpoint_wrapper(block);    // after parallelize_module, before training
//   dtensor::ac::apply_ac<dtensor::models::TransformerBlockImpl>(*model, ACMode::full);
//
// Only modules whose forward routes through call_forward (dtensor/tp/module_hooks.h) can be
// checkpointed; their forward's code outside call_forward runs once (it is not recomputed).
// A module called under no-grad (evaluation) runs normally.
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/tp/module_hooks.h"

namespace dtensor::ac {

/// torchtitan's activation checkpointing modes.
enum class ACMode {
  none,       ///< Nothing recomputed.
  full,       ///< Every block recomputes its forward in backward.
  selective,  ///< Every ACOptions::selective_every-th block (see apply_ac).
};
/// "none" | "full" | "selective".
const char* ac_mode_name(ACMode mode);
/// Parses ac_mode_name's names; throws listing them otherwise.
ACMode parse_ac_mode(const std::string& name);

/// Calls a checkpointed module's forward again on a saved call (the glue that knows its type).
using Rerun = std::function<c10::IValue(torch::nn::Module& module, const tp::ModuleCall& call)>;

/// Options of checkpoint_module.
struct CheckpointOptions {
  /// Names the module in errors; empty: its path in the model (fqn), else its class name.
  std::string name;
  /// true: the forward's collectives are recorded and handed back to the recompute, which
  /// adds no collective but keeps their results until backward. false: the recompute issues
  /// them again (PyTorch's checkpoint), keeping only the module's inputs: under TP without
  /// sequence parallelism a block's two all_reduce results, each as large as its input.
  bool replay_collectives = true;
};

/// Checkpoints `module` (a HookedModule owned by a shared_ptr); `rerun` must call its forward
/// with the call's arguments. checkpoint_wrapper builds rerun from the type; use this for a
/// module whose forward takes keyword arguments (tp::Kwargs) or is overloaded.
void checkpoint_module(torch::nn::Module& module, Rerun rerun, CheckpointOptions options = {});
/// Whether checkpoint_module (or checkpoint_wrapper) was applied to `module`.
bool is_checkpointed(const torch::nn::Module& module);
/// Stops checkpointing `module`.
void remove_checkpoint(torch::nn::Module& module);

namespace detail {
template <class F>
struct ForwardArgs;
template <class R, class C, class... A>
struct ForwardArgs<R (C::*)(A...)> {
  using type = std::tuple<std::decay_t<A>...>;
};
template <class Impl, size_t... I>
c10::IValue call_forward_with(Impl& m, const tp::ModuleCall& c, std::index_sequence<I...>) {
  using Args = typename ForwardArgs<decltype(&Impl::forward)>::type;
  TORCH_CHECK(c.args.size() == sizeof...(I), "dtensor::ac: ", m.name(), "::forward takes ",
              sizeof...(I), " positional arguments, the saved call has ", c.args.size());
  return c10::IValue(m.forward(c.args[I].template to<std::tuple_element_t<I, Args>>()...));
}
}  // namespace detail

/// Checkpoints a module whose forward takes positional arguments (PyTorch's checkpoint_wrapper,
/// applied in place: the module keeps its name and parameter paths).
template <class Impl>
requires std::is_base_of_v<torch::nn::Module, Impl>
void checkpoint_wrapper(Impl& module, CheckpointOptions options = {}) {
  using Args = typename detail::ForwardArgs<decltype(&Impl::forward)>::type;
  checkpoint_module(
      module,
      [](torch::nn::Module& m, const tp::ModuleCall& call) {
        return detail::call_forward_with(static_cast<Impl&>(m), call,
                                         std::make_index_sequence<std::tuple_size_v<Args>>{});
      },
      std::move(options));
}
/// Same, through a module holder.
template <class Impl>
void checkpoint_wrapper(const torch::nn::ModuleHolder<Impl>& module,
                        CheckpointOptions options = {}) {
  checkpoint_wrapper(*module.ptr(), std::move(options));
}

/// Options of apply_ac.
struct ACOptions {
  /// ACMode::selective checkpoints blocks selective_every-1, 2*selective_every-1, ... (0-based,
  /// in model order): with 2, every other block, half the activation memory saved for about half
  /// the recompute (torchtitan's layer-level selective AC; its op-level policy needs per-op
  /// interception that LibTorch does not offer).
  int64_t selective_every = 2;
  /// CheckpointOptions::replay_collectives of every wrapped block.
  bool replay_collectives = true;
};

/// Checkpoints the modules of type Block under `root` (in named_modules order) as `mode` says,
/// and returns their paths. Call after parallelize_module / apply_tensor_parallel.
template <class Block>
std::vector<std::string> apply_ac(torch::nn::Module& root, ACMode mode, ACOptions options = {}) {
  TORCH_CHECK(options.selective_every >= 1,
              "dtensor::ac::apply_ac: selective_every must be >= 1, got ", options.selective_every);
  std::vector<std::string> wrapped;
  if (mode == ACMode::none) return wrapped;
  int64_t index = 0;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    auto* block = dynamic_cast<Block*>(item.value().get());
    if (block == nullptr) continue;
    const int64_t i = index++;
    if (mode == ACMode::selective && (i + 1) % options.selective_every != 0) continue;
    checkpoint_wrapper(*block, {item.key(), options.replay_collectives});
    wrapped.push_back(item.key());
  }
  return wrapped;
}

}  // namespace dtensor::ac
