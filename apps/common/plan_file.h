#pragma once
// A tensor-parallel plan read from a JSON file (dtensor_train --plan FILE): whether it shards the
// sequence between blocks, said explicitly, and an object whose keys are module paths (with
// wildcards, as parallelize_module takes them) and whose values are styles written as in
// PyTorch, in the order they apply:
//   {"sequence_parallel": false,
//    "plan": {"layers.*.attention.wq": "ColwiseParallel()",
//             "output": "ColwiseParallel(output_layouts=Replicate())"}}
// dtensor_train --print-plan writes the built-in plan (models::tensor_parallel_plan) so;
// apps/train/plans/llama_tp.json is what it prints for the tiny preset at TP 2 (sequence and loss
// parallel).
#include <string>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/transformer.h"
#include "dtensor/tp/parallelize_module.h"

namespace dtensor::train {

struct PlanFile {
  std::string path;
  tp::ParallelizePlan plan;
  bool sequence_parallel = false;  // the file's "sequence_parallel"
};

// Reads and parses `path`. Throws std::invalid_argument naming the file and, for a bad entry,
// its key and what is wrong with its style.
PlanFile read_plan_file(const std::string& path);

// `plan` (and whether it shards the sequence) as a plan file, the form read_plan_file reads.
std::string plan_file_json(const tp::ParallelizePlan& plan, bool sequence_parallel);

// Parallelizes `model` over the 1-D `tp_mesh` with the plan instead of the built-in one
// (models::apply_tensor_parallel with TensorParallelOptions::plan). Errors name the file.
void apply_plan_file(models::TransformerImpl& model, const DeviceMesh& tp_mesh,
                     const PlanFile& plan);

}  // namespace dtensor::train
