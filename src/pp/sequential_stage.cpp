// A torch::nn::Sequential split into pipeline stages.
#include "dtensor/pp/sequential_stage.h"

#include <c10/util/Exception.h>

#include <string>

namespace dtensor::pp {

torch::nn::Sequential split_sequential(const torch::nn::Sequential& whole, int64_t first,
                                       int64_t end) {
  const auto n = static_cast<int64_t>(whole->size());
  TORCH_CHECK(0 <= first && first < end && end <= n, "split_sequential: the range [", first, ", ",
              end, ") is not a non-empty range of the ", n, " modules of the Sequential");
  torch::nn::Sequential part;
  for (int64_t i = first; i < end; ++i)
    part->push_back(std::to_string(i), *(whole->begin() + i));  // shares the module
  return part;
}

SequentialStage make_sequential_stage(const torch::nn::Sequential& whole, const DeviceMesh& mesh) {
  auto pp_mesh = get_pp_mesh(mesh);
  TORCH_CHECK(pp_mesh, "make_sequential_stage needs a mesh with a dimension named \"pp\", got ",
              mesh.str());
  const int64_t stages = pp_mesh->size(), n = static_cast<int64_t>(whole->size());
  TORCH_CHECK(n >= stages, "make_sequential_stage: the Sequential has ", n,
              " modules, fewer than the ", stages, " pipeline stages of ", mesh.str());
  SequentialStage out;
  std::tie(out.first, out.end) = stage_layer_range(n, pp_mesh->get_local_rank(), stages);
  out.module = split_sequential(whole, out.first, out.end);
  out.stage = std::make_unique<PipelineStage>(
      [module = out.module](const at::Tensor& x) mutable { return module->forward(x); }, mesh);
  return out;
}

}  // namespace dtensor::pp
