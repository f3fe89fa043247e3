// ColwiseParallel: output features sharded; the input is replicated.
#include <torch/nn/modules/embedding.h>

#include "dtensor/tp/styles.h"
#include "style_support.h"

namespace dtensor::tp {
namespace {

// Without hooks, a Replicate DTensor input already gives the Shard(-1) output.
detail::LinearStyleSpec linear_spec(const ColwiseParallel& s) {
  return {"ColwiseParallel", s.input_layout(), Replicate(),
          s.output_layout(), Shard(-1),        s.options().use_local_output};
}

}  // namespace

ColwiseParallel::ColwiseParallel(ColwiseParallelOptions options) : options_(std::move(options)) {}

std::string ColwiseParallel::repr() const { return detail::linear_style_repr(linear_spec(*this)); }

void ColwiseParallel::validate(torch::nn::Module& module, const std::string& fqn,
                               const DeviceMesh& /*mesh*/) const {
  detail::check_linear_or_embedding(linear_spec(*this), module, fqn);
  detail::check_hooks_not_needed(linear_spec(*this), module, fqn);
}

void ColwiseParallel::apply(torch::nn::Module& module, const std::string& fqn,
                            const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  const bool embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&module) != nullptr;
  detail::apply_linear_style(linear_spec(*this), module, mesh, src_data_rank,
                             detail::colwise_layout(embedding));
}

}  // namespace dtensor::tp
