#pragma once
// What the built-in styles share: printing layouts as PyTorch does, the hook-capability check
// with its message, and the conversions their hooks apply to inputs and outputs.
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/core/placement.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/tp/module_hooks.h"
#include "dtensor/tp/styles.h"

namespace dtensor::tp::detail {

// Python spellings: True/False, None, (Shard(dim=0), None), (Replicate(),), {'y': Shard(dim=0)}.
std::string py_bool(bool b);
std::string py_layout(const std::optional<Placement>& p);
std::string py_tuple(const Layouts& layouts);
std::string py_optional_tuple(const std::optional<Layouts>& layouts);
std::string py_dict(const std::optional<KwargLayouts>& layouts);

// "torch::nn::Linear" for a torch::nn::LinearImpl (the name users write).
std::string module_type_name(const torch::nn::Module& module);
// "'layers.0.wq' (torch::nn::Linear)", or "the root module (...)" for "".
std::string describe_module(const torch::nn::Module& module, const std::string& fqn);

inline HookedModule* hooks_of(torch::nn::Module& module) {
  return dynamic_cast<HookedModule*>(&module);
}

// Throws the error for a style that needs hooks on a module without them. `need` says which
// conversion needs a hook; `dtensor_alternative` is the change of arguments (if any) that would
// make the style acceptable on this module.
[[noreturn]] void throw_needs_hooks(const torch::nn::Module& module, const std::string& fqn,
                                    const std::string& style_repr, const std::string& need,
                                    const std::string& dtensor_alternative);

// Shards `module`'s own parameters through distribute_module: each gets the placement `layout`
// returns for its name (distribute_tensor from `src_data_rank`), or, for nullopt, is left to
// distribute_module's replication.
using ParamLayout = std::function<std::optional<Placement>(const std::string& name)>;
void distribute_parameters(torch::nn::Module& module, const DeviceMesh& mesh,
                           std::optional<int64_t> src_data_rank, const ParamLayout& layout);
// Colwise: Linear weight [out, in] and bias [out] split the output features (Shard(0));
// Embedding [num, dim] splits the embedding dim (Shard(1)).
ParamLayout colwise_layout(bool embedding);
// Rowwise: Linear weight Shard(1) (input features), bias Replicate (sharding propagation
// divides it among the Partial sums); Embedding Shard(0) (vocab rows).
ParamLayout rowwise_layout(bool linear);

// What ColwiseParallel and RowwiseParallel share. `input_desired` is what the module computes
// on; `plain_output` is what it returns without hooks (Colwise: Shard(-1), Rowwise: the Partial
// sum, which its consumer reduces exactly as a Replicate output hook would).
struct LinearStyleSpec {
  const char* name;  // "ColwiseParallel"
  Placement input, input_desired, output, plain_output;
  bool use_local_output;
};
// "ColwiseParallel(input_layouts=(Replicate(),), output_layouts=(...), use_local_output=True)".
std::string linear_style_repr(const LinearStyleSpec& s);
// Throws PyTorch's error unless `module` is a Linear or an Embedding; returns whether a Linear.
bool check_linear_or_embedding(const LinearStyleSpec& s, const torch::nn::Module& module,
                               const std::string& fqn);
// On a module without hooks, throws naming each conversion that would need one.
void check_hooks_not_needed(const LinearStyleSpec& s, torch::nn::Module& module,
                            const std::string& fqn);
// Shards the parameters with `layout`, then installs the input and output hooks when the module
// has hooks.
void apply_linear_style(const LinearStyleSpec& s, torch::nn::Module& module, const DeviceMesh& mesh,
                        std::optional<int64_t> src_data_rank, const ParamLayout& layout);

// One input or output of a Prepare* style: untouched without a layout; else a plain tensor
// becomes a DTensor with `layout`, is redistributed (synchronously) to `desired` when that is
// given and differs, and is returned as its local shard when `use_local`. `what` is "input" or
// "output", for the message when the value is not a tensor.
c10::IValue prepare_value(const c10::IValue& value, const DeviceMesh& mesh,
                          const std::optional<Placement>& layout,
                          const std::optional<Placement>& desired, bool use_local,
                          const char* what = "input");

}  // namespace dtensor::tp::detail
