#pragma once
// parallelize_module (spec §6.7): apply one style to a module, or a plan of styles to its
// submodules by path. Plan keys are matched one path segment at a time with shell wildcards
// ("layers.*.attention.wq", "net[1-2]"); "" is the module itself; entries apply in order.
// A key that matches nothing warns and is skipped. The mesh must be 1-D (slice mesh["tp"]).
// Every entry is validated before anything changes, and a failure part-way restores the
// module's parameters and hooks, so a failed call leaves the model as it was.
#include <torch/nn/module.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/tp/parallel_style.h"

namespace dtensor::tp {

using ParallelizePlan = std::vector<std::pair<std::string, Style>>;

// src_data_rank: group rank parameters are scattered/broadcast from, or nullopt for none
// (each rank keeps its own values; no communication).
torch::nn::Module& parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                                      const Style& style, std::optional<int64_t> src_data_rank = 0);
torch::nn::Module& parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                                      const ParallelizePlan& plan,
                                      std::optional<int64_t> src_data_rank = 0);
// With the mesh from the innermost MeshGuard.
torch::nn::Module& parallelize_module(torch::nn::Module& module, const Style& style,
                                      std::optional<int64_t> src_data_rank = 0);
torch::nn::Module& parallelize_module(torch::nn::Module& module, const ParallelizePlan& plan,
                                      std::optional<int64_t> src_data_rank = 0);

}  // namespace dtensor::tp
