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
using KwargLayouts = std::map<std::string, std::optional<Placement>>;

struct ColwiseParallelOptions {
  std::optional<Placement> input_layouts;   // default Replicate
  std::optional<Placement> output_layouts;  // default Shard(-1)
  bool use_local_output = true;
};

/// Linear: weight and bias Shard(0); Embedding: weight Shard(1). Output sharded on the last dim.
/// Other module types: "ColwiseParallel currently only support nn.Linear and nn.Embedding!".
class ColwiseParallel : public ParallelStyle {
 public:
  explicit ColwiseParallel(ColwiseParallelOptions options = {});
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  bool uses_distribute_module() const override { return true; }
  const ColwiseParallelOptions& options() const { return options_; }
  Placement input_layout() const { return options_.input_layouts.value_or(Replicate()); }
  Placement output_layout() const { return options_.output_layouts.value_or(Shard(-1)); }

 private:
  ColwiseParallelOptions options_;
};

struct RowwiseParallelOptions {
  std::optional<Placement> input_layouts;   // default Shard(-1)
  std::optional<Placement> output_layouts;  // default Replicate
  bool use_local_output = true;
};

/// Linear: weight Shard(1), bias Replicate; Embedding: weight Shard(0) (vocab rows). The desired
/// input is Shard(-1) for Linear and Replicate (the indices) for Embedding.
class RowwiseParallel : public ParallelStyle {
 public:
  explicit RowwiseParallel(RowwiseParallelOptions options = {});
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  bool uses_distribute_module() const override { return true; }
  const RowwiseParallelOptions& options() const { return options_; }
  Placement input_layout() const { return options_.input_layouts.value_or(Shard(-1)); }
  Placement output_layout() const { return options_.output_layouts.value_or(Replicate()); }

 private:
  RowwiseParallelOptions options_;
};

struct SequenceParallelOptions {
  int64_t sequence_dim = 1;
  bool use_local_output = false;
};

/// Norms and dropout on sequence-sharded activations. Parameters become Replicate DTensors over
/// each rank's own values, without a broadcast (they must be initialised identically, as the
/// ones/zeros of LayerNorm and RMSNorm are). A plain input is taken as this rank's sequence
/// shard; a DTensor input in another layout is redistributed to Shard(sequence_dim).
class SequenceParallel : public ParallelStyle {
 public:
  explicit SequenceParallel(SequenceParallelOptions options = {});
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  bool uses_distribute_module() const override { return true; }
  const SequenceParallelOptions& options() const { return options_; }

 private:
  SequenceParallelOptions options_;
};

struct PrepareModuleInputOptions {
  std::optional<Layouts> input_layouts;
  std::optional<Layouts> desired_input_layouts;
  std::optional<KwargLayouts> input_kwarg_layouts;
  std::optional<KwargLayouts> desired_input_kwarg_layouts;
  bool use_local_output = false;
};

/// Converts the module's positional (and keyword) inputs: a plain tensor becomes a DTensor with
/// its input layout, then it is redistributed (synchronously) to the desired layout. Checks at
/// construction: "desired module inputs should not be None!", "input_layouts and
/// desired_input_layouts should have same length!", "input_kwarg_layouts and
/// desired_input_kwarg_layouts should have same length!"; at call time: "module inputs and
/// input_layouts should have same length!", "expecting input to be a torch.Tensor!".
class PrepareModuleInput : public ParallelStyle {
 public:
  explicit PrepareModuleInput(PrepareModuleInputOptions options = {});
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  const PrepareModuleInputOptions& options() const { return options_; }

 private:
  PrepareModuleInputOptions options_;
};

struct PrepareModuleOutputOptions {
  Layouts output_layouts;
  Layouts desired_output_layouts;
  bool use_local_output = true;
};

/// Converts the module's outputs (one, or the elements of a returned tuple). Checks: "output_layouts
/// and desired_output_layouts should have same length!" (construction), "module outputs and
/// output_layouts should have same length!" (call).
class PrepareModuleOutput : public ParallelStyle {
 public:
  explicit PrepareModuleOutput(PrepareModuleOutputOptions options);
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  const PrepareModuleOutputOptions& options() const { return options_; }

 private:
  PrepareModuleOutputOptions options_;
};

struct PrepareModuleInputOutputOptions {
  std::optional<Layouts> input_layouts;
  std::optional<Layouts> desired_input_layouts;
  std::optional<KwargLayouts> input_kwarg_layouts;
  std::optional<KwargLayouts> desired_input_kwarg_layouts;
  bool use_local_input = false;
  Layouts output_layouts;
  Layouts desired_output_layouts;
  bool use_local_output = true;
};

/// PrepareModuleInput(use_local_output = use_local_input) and PrepareModuleOutput on one module.
class PrepareModuleInputOutput : public ParallelStyle {
 public:
  explicit PrepareModuleInputOutput(PrepareModuleInputOutputOptions options);
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  const PrepareModuleInput& input_style() const { return input_; }
  const PrepareModuleOutput& output_style() const { return output_; }

 private:
  PrepareModuleInput input_;
  PrepareModuleOutput output_;
};

}  // namespace dtensor::tp
