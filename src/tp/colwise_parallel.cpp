// ColwiseParallel (spec §6.1): output features sharded; the input is replicated.
#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "dtensor/tp/styles.h"
#include "style_support.h"

namespace dtensor::tp {

ColwiseParallel::ColwiseParallel(ColwiseParallelOptions options) : options_(std::move(options)) {}

std::string ColwiseParallel::repr() const {
  return "ColwiseParallel(input_layouts=(" + input_layout().repr() + ",), output_layouts=(" +
         output_layout().repr() +
         ",), use_local_output=" + detail::py_bool(options_.use_local_output) + ")";
}

void ColwiseParallel::validate(torch::nn::Module& module, const std::string& fqn,
                               const DeviceMesh& mesh) const {
  const bool linear = dynamic_cast<torch::nn::LinearImpl*>(&module) != nullptr;
  const bool embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&module) != nullptr;
  TORCH_CHECK_NOT_IMPLEMENTED(
      linear || embedding,
      "ColwiseParallel currently only support nn.Linear and nn.Embedding! "
      "(",
      detail::describe_module(module, fqn),
      " is neither a torch::nn::LinearImpl nor a torch::nn::EmbeddingImpl)");
  if (detail::hooks_of(module)) return;
  // Without hooks, a Replicate DTensor input already gives the Shard(-1) output.
  std::vector<std::string> needs;
  if (input_layout() != Replicate())
    needs.push_back("taking the input as input_layouts=(" + input_layout().repr() +
                    ",) and redistributing it to Replicate()");
  if (output_layout() != Shard(-1))
    needs.push_back("redistributing the output to output_layouts=(" + output_layout().repr() +
                    ",)");
  if (options_.use_local_output)
    needs.push_back("returning the local shard (use_local_output=True)");
  if (needs.empty()) return;
  const bool only_local = needs.size() == 1 && options_.use_local_output;
  detail::throw_needs_hooks(module, fqn, repr(), c10::Join(" and ", needs),
                            only_local ? "set use_local_output=false and pass DTensor inputs"
                                       : "keep the default layouts, set use_local_output=false "
                                         "and pass Replicate DTensor inputs");
}

void ColwiseParallel::apply(torch::nn::Module& module, const std::string& fqn,
                            const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  const bool embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&module) != nullptr;
  detail::distribute_parameters(module, mesh, src_data_rank, detail::colwise_layout(embedding));
  if (HookedModule* hooks = detail::hooks_of(module)) {
    hooks->register_forward_pre_hook(
        [mesh, input = input_layout()](torch::nn::Module& m, ModuleCall& call) {
          detail::prepare_first_input(call, mesh, input, Replicate(), "ColwiseParallel", m);
        });
    hooks->register_forward_hook([output = output_layout(), local = options_.use_local_output](
                                     torch::nn::Module& m, const ModuleCall&, c10::IValue& out) {
      detail::prepare_single_output(out, output, local, "ColwiseParallel", m);
    });
  }
}

}  // namespace dtensor::tp
