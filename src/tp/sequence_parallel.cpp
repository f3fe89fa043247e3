// SequenceParallel: the module runs on activations sharded along the sequence dim, with replicated
// parameters.
#include <c10/util/Exception.h>

#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/tp/styles.h"
#include "style_support.h"

namespace dtensor::tp {

SequenceParallel::SequenceParallel(SequenceParallelOptions options)
    : options_(std::move(options)) {}

std::string SequenceParallel::repr() const {
  return "SequenceParallel(sequence_dim=" + std::to_string(options_.sequence_dim) +
         ", use_local_output=" + detail::py_bool(options_.use_local_output) + ")";
}

void SequenceParallel::validate(torch::nn::Module& module, const std::string& fqn,
                                const DeviceMesh& mesh) const {
  // Any module whose ops have rules works (norms, dropout); only the hook is in question.
  if (detail::hooks_of(module) || !options_.use_local_output) return;
  detail::throw_needs_hooks(module, fqn, repr(),
                            "returning the local shard (use_local_output=True)",
                            "set use_local_output=false and pass DTensor inputs");
}

void SequenceParallel::apply(torch::nn::Module& module, const std::string& fqn,
                             const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  distribute_module(
      module, mesh,
      [](const std::string&, torch::nn::Module& sub, const DeviceMesh& m) {
        // Each rank wraps its own values (no broadcast): norm weights start as ones/zeros on
        // every rank, as PyTorch assumes.
        for (const auto& p : sub.named_parameters(/*recurse=*/false)) {
          if (!p.value().defined()) continue;
          replace_parameter(sub, p.key(), from_local(p.value().detach(), m, {Replicate()}));
        }
      },
      src_data_rank);
  HookedModule* hooks = detail::hooks_of(module);
  if (!hooks) return;
  const Placement sharding = Shard(options_.sequence_dim);
  hooks->register_forward_pre_hook([mesh, sharding](torch::nn::Module& m, ModuleCall& call) {
    TORCH_CHECK_VALUE(
        !call.args.empty() && call.args[0].isTensor(), "expecting input of ",
        detail::module_type_name(m), " to be a torch.Tensor or DTensor, but got ",
        call.args.empty() ? std::string("no positional input") : call.args[0].tagKind());
    at::Tensor input = call.args[0].toTensor();
    if (!is_dtensor(input)) {
      // Taken as this rank's slice of the sequence.
      input = from_local(input, mesh, {sharding});
    } else {
      const Placements& current = placements(input);
      if (current.size() != 1 || current[0] != sharding.normalized(input.dim()))
        input = redistribute(input, {sharding}, {.async_op = true});
    }
    call.args[0] = std::move(input);
  });
  if (options_.use_local_output) {
    hooks->register_forward_hook([](torch::nn::Module&, const ModuleCall&, c10::IValue& out) {
      TORCH_CHECK(out.isTensor(), "SequenceParallel expects the module to return a tensor, got ",
                  out.tagKind());
      if (is_dtensor(out.toTensor())) out = to_local(out.toTensor());
    });
  }
}

}  // namespace dtensor::tp
