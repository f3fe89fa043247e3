#pragma once
// parallelize_module: apply one style to a module, or a plan of styles to its submodules by path.
// Plan keys are matched one path segment at a time with shell wildcards ("layers.*.attention.wq",
// "net[1-2]", "net?", "[!x]*") against the names of direct children (ModuleList/Sequential indices
// included); "" is the module itself; entries apply in order. A key that matches nothing warns
// (TORCH_WARN, PyTorch's text) and is skipped. The mesh must be 1-D (slice mesh["tp"] first).
//
// Every (module, style) pair is validated before anything changes (a style's own checks, and
// no module sharded by two styles or sharded again), and a failure part-way through applying
// restores every swapped parameter and buffer and removes every hook added, so a failed call
// leaves the model as it was. Hook-capable modules are named by their path (tp::name_modules)
// so CommDebugMode attributes collectives to them.
//
// Before anything else, the ranks of the mesh check that they all have the same plan (keys
// and style reprs, in order), the same model structure (parameter and buffer names, shapes,
// dtypes) and the same mesh: one all_gather of a 64-bit hash over the mesh's group (counted
// by CommDebugMode; none on a 1-rank mesh). On a difference every rank throws, before
// changing anything, naming the first difference ("rank 1 differs from rank 0 at plan key
// 'net1': ColwiseParallel(...) on rank 0 vs RowwiseParallel(...) on rank 1"); the
// descriptions are exchanged only then (two more all_gathers).
//
// Unlike PyTorch, src_data_rank also reaches the style of the root key "" (PyTorch's recursive
// call drops it), and parameters that a style leaves to distribute_module's replication honour
// it too.
#include <torch/nn/module.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/tp/parallel_style.h"

namespace dtensor::tp {

/// (plan key, style) pairs, applied in order; keys are path patterns (see above).
using ParallelizePlan = std::vector<std::pair<std::string, Style>>;

/// src_data_rank: group rank parameters are scattered/broadcast from, or nullopt for none
/// (each rank keeps its own values; no communication). Returns `module`.
torch::nn::Module& parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                                      const Style& style, std::optional<int64_t> src_data_rank = 0);
/// Applies each entry of `plan` to the submodules its key matches (see above).
torch::nn::Module& parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                                      const ParallelizePlan& plan,
                                      std::optional<int64_t> src_data_rank = 0);
/// With the mesh from the innermost MeshGuard.
torch::nn::Module& parallelize_module(torch::nn::Module& module, const Style& style,
                                      std::optional<int64_t> src_data_rank = 0);
/// `plan` with the mesh from the innermost MeshGuard.
torch::nn::Module& parallelize_module(torch::nn::Module& module, const ParallelizePlan& plan,
                                      std::optional<int64_t> src_data_rank = 0);
/// No plan: warns that auto-parallel is not supported and returns the module unchanged.
torch::nn::Module& parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh);
/// Same, with the mesh from the innermost MeshGuard.
torch::nn::Module& parallelize_module(torch::nn::Module& module);

/// Python's fnmatch.fnmatchcase: '*' any run, '?' one character, "[a-c]" / "[!x]" classes; a
/// '[' without a closing ']' is literal.
bool fnmatch(std::string_view pattern, std::string_view name);

}  // namespace dtensor::tp
