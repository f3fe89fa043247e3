#pragma once
// The built-in parallel styles (spec §6.1–6.6), with PyTorch's arguments and defaults.
// Options are aggregates, so arguments read like Python keywords:
//   ColwiseParallel({.input_layouts = Shard(0), .use_local_output = false})
// A layout left empty means PyTorch's default (None).
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/core/placement.h"
#include "dtensor/tp/parallel_style.h"

namespace dtensor::tp {

// Per-input layouts of Prepare* styles; an empty entry (PyTorch's None) leaves that input alone.
using Layouts = std::vector<std::optional<Placement>>;
using KwargLayouts = std::map<std::string, std::optional<Placement>>;

struct ColwiseParallelOptions {
  std::optional<Placement> input_layouts;   // default Replicate
  std::optional<Placement> output_layouts;  // default Shard(-1)
  bool use_local_output = true;
};

// Linear: weight and bias Shard(0); Embedding: weight Shard(1). Output sharded on the last dim.
class ColwiseParallel : public ParallelStyle {
 public:
  explicit ColwiseParallel(ColwiseParallelOptions options = {});
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  const ColwiseParallelOptions& options() const { return options_; }

 private:
  ColwiseParallelOptions options_;
};

struct RowwiseParallelOptions {
  std::optional<Placement> input_layouts;   // default Shard(-1)
  std::optional<Placement> output_layouts;  // default Replicate
  bool use_local_output = true;
};

// Linear: weight Shard(1), bias Replicate; Embedding: weight Shard(0) (vocab rows).
class RowwiseParallel : public ParallelStyle {
 public:
  explicit RowwiseParallel(RowwiseParallelOptions options = {});
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
  const RowwiseParallelOptions& options() const { return options_; }

 private:
  RowwiseParallelOptions options_;
};

struct SequenceParallelOptions {
  int64_t sequence_dim = 1;
  bool use_local_output = false;
};

// Norms and dropout on sequence-sharded activations; parameters Replicate without broadcast.
class SequenceParallel : public ParallelStyle {
 public:
  explicit SequenceParallel(SequenceParallelOptions options = {});
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;
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

class PrepareModuleInputOutput : public ParallelStyle {
 public:
  explicit PrepareModuleInputOutput(PrepareModuleInputOutputOptions options);
  std::string repr() const override;
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;

 private:
  PrepareModuleInput input_;
  PrepareModuleOutput output_;
};

}  // namespace dtensor::tp
