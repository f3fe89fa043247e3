// RowwiseParallel (spec §6.2): input features sharded; the output is a Partial sum reduced to
// output_layouts.
#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "dtensor/tp/styles.h"
#include "style_support.h"

namespace dtensor::tp {
namespace {

// Linear computes on the last input dim sharded; Embedding looks up replicated indices.
Placement desired_input(bool linear) { return linear ? Shard(-1) : Replicate(); }

}  // namespace

RowwiseParallel::RowwiseParallel(RowwiseParallelOptions options) : options_(std::move(options)) {}

std::string RowwiseParallel::repr() const {
  return "RowwiseParallel(input_layouts=(" + input_layout().repr() + ",), output_layouts=(" +
         output_layout().repr() +
         ",), use_local_output=" + detail::py_bool(options_.use_local_output) + ")";
}

void RowwiseParallel::validate(torch::nn::Module& module, const std::string& fqn,
                               const DeviceMesh& mesh) const {
  const bool linear = dynamic_cast<torch::nn::LinearImpl*>(&module) != nullptr;
  const bool embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&module) != nullptr;
  TORCH_CHECK_NOT_IMPLEMENTED(
      linear || embedding,
      "RowwiseParallel currently only support nn.Linear and nn.Embedding! "
      "(",
      detail::describe_module(module, fqn),
      " is neither a torch::nn::LinearImpl nor a torch::nn::EmbeddingImpl)");
  if (detail::hooks_of(module)) return;
  // Without hooks the Partial output is left for its consumer to reduce (the same all_reduce
  // the Replicate output hook would issue); anything else needs the hooks.
  const Placement desired = desired_input(linear);
  std::vector<std::string> needs;
  if (input_layout() != desired)
    needs.push_back("taking the input as input_layouts=(" + input_layout().repr() +
                    ",) and redistributing it to " + desired.repr());
  if (output_layout() != Replicate())
    needs.push_back("reducing the output to output_layouts=(" + output_layout().repr() + ",)");
  if (options_.use_local_output)
    needs.push_back("returning the local tensor (use_local_output=True)");
  if (needs.empty()) return;
  const bool only_local = needs.size() == 1 && options_.use_local_output;
  detail::throw_needs_hooks(module, fqn, repr(), c10::Join(" and ", needs),
                            only_local
                                ? "set use_local_output=false and pass DTensor inputs"
                                : "keep the default layouts, set use_local_output=false and pass " +
                                      desired.repr() + " DTensor inputs");
}

void RowwiseParallel::apply(torch::nn::Module& module, const std::string& fqn,
                            const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  const bool linear = dynamic_cast<torch::nn::LinearImpl*>(&module) != nullptr;
  detail::distribute_parameters(module, mesh, src_data_rank, detail::rowwise_layout(linear));
  if (HookedModule* hooks = detail::hooks_of(module)) {
    hooks->register_forward_pre_hook(
        [mesh, input = input_layout(), desired = desired_input(linear)](torch::nn::Module& m,
                                                                        ModuleCall& call) {
          detail::prepare_first_input(call, mesh, input, desired, "RowwiseParallel", m);
        });
    hooks->register_forward_hook([output = output_layout(), local = options_.use_local_output](
                                     torch::nn::Module& m, const ModuleCall&, c10::IValue& out) {
      detail::prepare_single_output(out, output, local, "RowwiseParallel", m);
    });
  }
}

}  // namespace dtensor::tp
