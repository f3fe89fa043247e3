// RowwiseParallel: input features sharded; the output is a Partial sum reduced to output_layouts.
#include <torch/nn/modules/linear.h>

#include "dtensor/tp/styles.h"
#include "style_support.h"

namespace dtensor::tp {
namespace {

// Linear computes on the last input dim sharded; Embedding looks up replicated indices. Without
// hooks the Partial output is left for its consumer to reduce (the same all_reduce the default
// Replicate output hook would issue), so Replicate counts as what the plain module returns.
detail::LinearStyleSpec linear_spec(const RowwiseParallel& s, bool linear) {
  return {"RowwiseParallel", s.input_layout(), linear ? Shard(-1) : Replicate(),
          s.output_layout(), Replicate(),      s.options().use_local_output};
}

bool is_linear(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::LinearImpl*>(&m) != nullptr;
}

}  // namespace

RowwiseParallel::RowwiseParallel(RowwiseParallelOptions options) : options_(std::move(options)) {}

std::string RowwiseParallel::repr() const {
  return detail::linear_style_repr(linear_spec(*this, /*linear=*/true));
}

void RowwiseParallel::validate(torch::nn::Module& module, const std::string& fqn,
                               const DeviceMesh& /*mesh*/) const {
  const bool linear = detail::check_linear_or_embedding(linear_spec(*this, true), module, fqn);
  detail::check_hooks_not_needed(linear_spec(*this, linear), module, fqn);
}

void RowwiseParallel::apply(torch::nn::Module& module, const std::string& fqn,
                            const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  const bool linear = is_linear(module);
  detail::apply_linear_style(linear_spec(*this, linear), module, mesh, src_data_rank,
                             detail::rowwise_layout(linear));
}

}  // namespace dtensor::tp
