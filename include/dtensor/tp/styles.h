#pragma once
// The built-in parallel styles, with PyTorch's arguments and defaults (docs/ARCHITECTURE.md,
// "Parallel styles and their defaults"). Options are aggregates, so arguments read like Python
// keywords:
//   ColwiseParallel({.input_layouts = Shard(0), .use_local_output = false})
// A layout left empty means PyTorch's default (None).
//
// Parameters are always swapped for DTensors (registry and public member), so any module
// computes through sharding propagation. Input/output conversion needs forward hooks, which
// only tp::HookedModule types have (dtensor::nn::Linear/Embedding/LayerNorm/Dropout/RMSNorm,
// and users' modules derived from dtensor::nn::Module that route forward through
// call_forward). On a hook-capable module every style installs PyTorch's hooks. On a plain
// torch::nn module a style is accepted only where skipping its hooks changes nothing for a
// caller that passes DTensors; validate() rejects the rest, naming the module, its type, the
// style and the fix:
//   ColwiseParallel   use_local_output=false, input_layouts Replicate (default) and
//                     output_layouts Shard(-1) (default): a Replicate DTensor input gives the
//                     Shard(-1) output the hooks would give.
//   RowwiseParallel   use_local_output=false, input_layouts equal to the desired input
//                     (Linear: Shard(-1), the default; Embedding: Replicate) and output_layouts
//                     Replicate (default): the output stays Partial and is reduced where it is
//                     used (full_tensor, the next op) — the same all_reduce, later.
//   SequenceParallel  use_local_output=false (default): a DTensor input is used in whatever
//                     layout it has (the hook would move it to Shard(sequence_dim)).
//   PrepareModule*    never: these styles are nothing but hooks.
// Plain tensors passed to such a module are not converted (the hook would have done that), so
// the kernel rejects them unless an ImplicitReplication guard treats them as Replicate.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/core/placement.h"
#include "dtensor/tp/parallel_style.h"

namespace dtensor::tp {

/// Per-input layouts of Prepare* styles; an empty entry (PyTorch's None) leaves that input alone.
using Layouts = std::vector<std::optional<Placement>>;
/// Per-keyword-argument layouts of Prepare* styles, keyed by argument name.
using KwargLayouts = std::map<std::string, std::optional<Placement>>;

/// Options of ColwiseParallel (PyTorch's keyword arguments).
struct ColwiseParallelOptions {
  std::optional<Placement> input_layouts;   // default Replicate
  std::optional<Placement> output_layouts;  // default Shard(-1)
  bool use_local_output = true;             ///< Return the output as a plain local tensor.
};

/// Linear: weight and bias Shard(0); Embedding: weight Shard(1). Output sharded on the last dim.
/// Other module types: "ColwiseParallel currently only support nn.Linear and nn.Embedding!".
class ColwiseParallel : public ParallelStyle {
 public:
  /// PyTorch's ColwiseParallel(...).
  explicit ColwiseParallel(ColwiseParallelOptions options = {});
  /// "ColwiseParallel(input_layouts=..., output_layouts=..., use_local_output=...)".
  std::string repr() const override;
  /// Rejects other module types, and plain modules with options that need hooks.
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  /// Shards the parameters and installs the input/output hooks.
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  /// Yes: parameters go through distribute_module.
  bool uses_distribute_module() const override { return true; }
  const ColwiseParallelOptions& options() const { return options_; }  ///< The options as given.
  /// input_layouts, or its default.
  Placement input_layout() const { return options_.input_layouts.value_or(Replicate()); }
  /// output_layouts, or its default.
  Placement output_layout() const { return options_.output_layouts.value_or(Shard(-1)); }

 private:
  ColwiseParallelOptions options_;
};

/// Options of RowwiseParallel (PyTorch's keyword arguments).
struct RowwiseParallelOptions {
  std::optional<Placement> input_layouts;   // default Shard(-1)
  std::optional<Placement> output_layouts;  // default Replicate
  bool use_local_output = true;             ///< Return the output as a plain local tensor.
};

/// Linear: weight Shard(1), bias Replicate; Embedding: weight Shard(0) (vocab rows). The desired
/// input is Shard(-1) for Linear and Replicate (the indices) for Embedding.
class RowwiseParallel : public ParallelStyle {
 public:
  /// PyTorch's RowwiseParallel(...).
  explicit RowwiseParallel(RowwiseParallelOptions options = {});
  /// "RowwiseParallel(input_layouts=..., output_layouts=..., use_local_output=...)".
  std::string repr() const override;
  /// Rejects other module types, and plain modules with options that need hooks.
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  /// Shards the parameters and installs the input/output hooks.
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  /// Yes: parameters go through distribute_module.
  bool uses_distribute_module() const override { return true; }
  const RowwiseParallelOptions& options() const { return options_; }  ///< The options as given.
  /// input_layouts, or its default.
  Placement input_layout() const { return options_.input_layouts.value_or(Shard(-1)); }
  /// output_layouts, or its default.
  Placement output_layout() const { return options_.output_layouts.value_or(Replicate()); }

 private:
  RowwiseParallelOptions options_;
};

/// Options of SequenceParallel (PyTorch's keyword arguments).
struct SequenceParallelOptions {
  int64_t sequence_dim = 1;       ///< The tensor dim of the sequence.
  bool use_local_output = false;  ///< Return the output as a plain local tensor.
};

/// Norms and dropout on sequence-sharded activations. Parameters become Replicate DTensors over
/// each rank's own values, without a broadcast (they must be initialised identically, as the
/// ones/zeros of LayerNorm and RMSNorm are). A plain input is taken as this rank's sequence
/// shard; a DTensor input in another layout is redistributed to Shard(sequence_dim).
class SequenceParallel : public ParallelStyle {
 public:
  /// PyTorch's SequenceParallel(...).
  explicit SequenceParallel(SequenceParallelOptions options = {});
  /// "SequenceParallel(sequence_dim=..., use_local_output=...)".
  std::string repr() const override;
  /// Rejects plain modules when use_local_output needs the output hook.
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  /// Replicates the parameters and installs the input/output hooks.
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  /// Yes: parameters go through distribute_module.
  bool uses_distribute_module() const override { return true; }
  const SequenceParallelOptions& options() const { return options_; }  ///< The options as given.

 private:
  SequenceParallelOptions options_;
};

/// Options of PrepareModuleInput (PyTorch's keyword arguments; empty = None).
struct PrepareModuleInputOptions {
  std::optional<Layouts> input_layouts;             ///< Layout of each positional input as passed.
  std::optional<Layouts> desired_input_layouts;     ///< Layout each positional input is moved to.
  std::optional<KwargLayouts> input_kwarg_layouts;  ///< Layout of each keyword input as passed.
  /// Layout each keyword input is moved to.
  std::optional<KwargLayouts> desired_input_kwarg_layouts;
  bool use_local_output = false;  ///< Pass the converted inputs on as plain local tensors.
};

/// Converts the module's positional (and keyword) inputs: a plain tensor becomes a DTensor with
/// its input layout, then it is redistributed (synchronously) to the desired layout. Checks at
/// construction: "desired module inputs should not be None!", "input_layouts and
/// desired_input_layouts should have same length!", "input_kwarg_layouts and
/// desired_input_kwarg_layouts should have same length!"; at call time: "module inputs and
/// input_layouts should have same length!", "expecting input to be a torch.Tensor!".
class PrepareModuleInput : public ParallelStyle {
 public:
  /// Checks the options (see above); throws with PyTorch's messages.
  explicit PrepareModuleInput(PrepareModuleInputOptions options = {});
  /// "PrepareModuleInput(input_layouts=..., desired_input_layouts=..., ...)".
  std::string repr() const override;
  /// Rejects modules without forward hooks (this style is only hooks).
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  /// Installs the forward pre-hook.
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  const PrepareModuleInputOptions& options() const { return options_; }  ///< The options as given.

 private:
  PrepareModuleInputOptions options_;
};

/// Options of PrepareModuleOutput (PyTorch's keyword arguments).
struct PrepareModuleOutputOptions {
  Layouts output_layouts;          ///< Layout of each output as returned.
  Layouts desired_output_layouts;  ///< Layout each output is moved to.
  bool use_local_output = true;    ///< Return the outputs as plain local tensors.
};

/// Converts the module's outputs (one, or the elements of a returned tuple). Checks: "output_layouts
/// and desired_output_layouts should have same length!" (construction), "module outputs and
/// output_layouts should have same length!" (call).
class PrepareModuleOutput : public ParallelStyle {
 public:
  /// Checks the options (see above); throws with PyTorch's messages.
  explicit PrepareModuleOutput(PrepareModuleOutputOptions options);
  /// "PrepareModuleOutput(output_layouts=..., desired_output_layouts=..., ...)".
  std::string repr() const override;
  /// Rejects modules without forward hooks (this style is only hooks).
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  /// Installs the forward hook.
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  const PrepareModuleOutputOptions& options() const { return options_; }  ///< The options as given.

 private:
  PrepareModuleOutputOptions options_;
};

/// Options of PrepareModuleInputOutput: PrepareModuleInput's then PrepareModuleOutput's.
struct PrepareModuleInputOutputOptions {
  std::optional<Layouts> input_layouts;             ///< Layout of each positional input as passed.
  std::optional<Layouts> desired_input_layouts;     ///< Layout each positional input is moved to.
  std::optional<KwargLayouts> input_kwarg_layouts;  ///< Layout of each keyword input as passed.
  /// Layout each keyword input is moved to.
  std::optional<KwargLayouts> desired_input_kwarg_layouts;
  bool use_local_input = false;    ///< Pass the converted inputs on as plain local tensors.
  Layouts output_layouts;          ///< Layout of each output as returned.
  Layouts desired_output_layouts;  ///< Layout each output is moved to.
  bool use_local_output = true;    ///< Return the outputs as plain local tensors.
};

/// PrepareModuleInput(use_local_output = use_local_input) and PrepareModuleOutput on one module.
class PrepareModuleInputOutput : public ParallelStyle {
 public:
  /// Builds both halves; throws as they do.
  explicit PrepareModuleInputOutput(PrepareModuleInputOutputOptions options);
  /// "PrepareModuleInputOutput(...)" with the arguments of both halves.
  std::string repr() const override;
  /// Rejects modules without forward hooks (this style is only hooks).
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  /// Installs both halves' hooks.
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  const PrepareModuleInput& input_style() const { return input_; }     ///< The input half.
  const PrepareModuleOutput& output_style() const { return output_; }  ///< The output half.

 private:
  PrepareModuleInput input_;
  PrepareModuleOutput output_;
};

}  // namespace dtensor::tp
