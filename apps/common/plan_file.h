#pragma once
// A tensor-parallel plan read from a JSON file (dtensor_train --plan FILE): one object whose
// keys are module paths (with wildcards, as parallelize_module takes them) and whose values
// are styles written as in PyTorch, in the order they apply:
//   {"layers.*.attention.wq": "ColwiseParallel()",
//    "output": "ColwiseParallel(output_layouts=Replicate())"}
// The file apps/train/plans/llama_tp.json is the built-in plan (sequence and loss parallel).
#include <string>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/transformer.h"
#include "dtensor/tp/parallelize_module.h"

namespace dtensor::train {

struct PlanFile {
  std::string path;
  tp::ParallelizePlan plan;
  bool sequence_parallel = false;  // some entry is SequenceParallel
};

// Reads and parses `path`. Throws std::invalid_argument naming the file and, for a bad entry,
// its key and what is wrong with its style.
PlanFile read_plan_file(const std::string& path);

// Parallelizes `model` over the 1-D `tp_mesh` with the plan instead of the built-in one.
// Errors while applying it name the file.
void apply_plan_file(models::TransformerImpl& model, const DeviceMesh& tp_mesh,
                     const PlanFile& plan);

}  // namespace dtensor::train
