// PyTorch 2.0-era tensor-parallel helpers and PairwiseParallel, on top of the current styles.
#include "dtensor/tp/compat.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>

#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "style_support.h"

namespace dtensor::tp {
namespace {

// The 1-D mesh a helper works on: the one given, else the DTensor's own.
DeviceMesh mesh_for(const at::Tensor& t, const std::optional<DeviceMesh>& mesh, const char* what) {
  TORCH_CHECK(mesh.has_value() || is_dtensor(t), "device_mesh is not passed nor can be inferred");
  DeviceMesh m = mesh ? *mesh : device_mesh(t);
  TORCH_CHECK(m.ndim() == 1, "device_mesh has dims ", m.ndim(), " but expected to be 1 for ", what,
              ".");
  return m;
}

at::Tensor input_as(const at::Tensor& input, const std::optional<DeviceMesh>& mesh, Placement p) {
  const DeviceMesh m = mesh_for(input, mesh, "input");
  return is_dtensor(input) ? redistribute(input, m, {p}) : from_local(input, m, {p});
}

at::Tensor output_as(const at::Tensor& output, const std::optional<DeviceMesh>& mesh, Placement p) {
  TORCH_CHECK(is_dtensor(output),
              "Expect output of Tensor Parallel to be a DTensor, but found a plain tensor.");
  return redistribute(output, mesh_for(output, mesh, "output"), {p});
}

}  // namespace

at::Tensor make_input_replicate_1d(const at::Tensor& input, const std::optional<DeviceMesh>& mesh) {
  return input_as(input, mesh, Replicate());
}

at::Tensor make_input_shard_1d(const at::Tensor& input, const std::optional<DeviceMesh>& mesh,
                               int64_t dim) {
  return input_as(input, mesh, Shard(dim));
}

at::Tensor make_input_shard_1d_last_dim(const at::Tensor& input,
                                        const std::optional<DeviceMesh>& mesh) {
  return make_input_shard_1d(input, mesh, input.dim() - 1);
}

at::Tensor make_input_reshard_replicate(const at::Tensor& input, const DeviceMesh& mesh) {
  return make_input_replicate_1d(make_input_shard_1d(input, mesh, 0), mesh);
}

at::Tensor make_output_shard_1d(const at::Tensor& output, const std::optional<DeviceMesh>& mesh,
                                int64_t dim) {
  return output_as(output, mesh, Shard(dim));
}

at::Tensor make_output_replicate_1d(const at::Tensor& output,
                                    const std::optional<DeviceMesh>& mesh) {
  return output_as(output, mesh, Replicate());
}

at::Tensor make_output_tensor(const at::Tensor& output, const std::optional<DeviceMesh>& mesh) {
  return to_local(make_output_replicate_1d(output, mesh));
}

at::Tensor make_sharded_output_tensor(const at::Tensor& output,
                                      const std::optional<DeviceMesh>& mesh) {
  TORCH_CHECK(is_dtensor(output),
              "Expect output of Tensor Parallel to be a DTensor, but found a plain tensor.");
  mesh_for(output, mesh, "output");
  return to_local(output);
}

at::Tensor make_output_reshard_tensor(const at::Tensor& output,
                                      const std::optional<DeviceMesh>& mesh) {
  return to_local(make_output_shard_1d(output, mesh, 0));
}

// ---- PairwiseParallel ----

namespace {

struct Mlp {
  torch::nn::Module* module;
  std::string fqn;
  std::vector<std::pair<std::string, torch::nn::Module*>> linears;  // (fqn, module), in order
};

// The MLPs under `module` by PyTorch 2.0's rule: a module with two or more direct Linear
// children is one; otherwise its children are searched.
void find_mlps(torch::nn::Module& module, const std::string& fqn, std::vector<Mlp>& out) {
  auto join = [&](const std::string& name) { return fqn.empty() ? name : fqn + "." + name; };
  Mlp mlp{&module, fqn, {}};
  for (const auto& child : module.named_children())
    if (dynamic_cast<torch::nn::LinearImpl*>(child.value().get()))
      mlp.linears.emplace_back(join(child.key()), child.value().get());
  if (mlp.linears.size() > 1) {
    mlp.linears.resize(mlp.linears.size() / 2 * 2);  // an odd last Linear stays as it is
    out.push_back(std::move(mlp));
    return;
  }
  for (const auto& child : module.named_children())
    find_mlps(*child.value(), join(child.key()), out);
}

}  // namespace

void PairwiseParallel::validate(torch::nn::Module& module, const std::string& fqn,
                                const DeviceMesh& mesh) const {
  std::vector<Mlp> mlps;
  find_mlps(module, fqn, mlps);
  for (const Mlp& mlp : mlps) {
    for (const auto& [name, linear] : mlp.linears)
      TORCH_CHECK(!is_distributed_module(*linear), repr(), ": ",
                  detail::describe_module(*linear, name),
                  " has already been parallelized (its parameters are DTensors)");
    const auto& [first_fqn, first] = mlp.linears.front();
    if (!detail::hooks_of(*first))
      detail::throw_needs_hooks(*first, first_fqn, repr(),
                                "replicating the MLP's input (make_input_replicate_1d)", "");
    const auto& [last_fqn, last] = mlp.linears.back();
    if (!detail::hooks_of(*last))
      detail::throw_needs_hooks(*last, last_fqn, repr(),
                                "returning the MLP's output as a replicated plain tensor "
                                "(make_output_tensor)",
                                "");
  }
}

void PairwiseParallel::apply(torch::nn::Module& module, const std::string& fqn,
                             const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  std::vector<Mlp> mlps;
  find_mlps(module, fqn, mlps);
  for (const Mlp& mlp : mlps) {
    const size_t n = mlp.linears.size();
    for (size_t i = 0; i < n; ++i) {
      torch::nn::Module& linear = *mlp.linears[i].second;
      const bool colwise = i % 2 == 0;
      detail::distribute_parameters(linear, mesh, src_data_rank,
                                    colwise ? detail::colwise_layout(/*embedding=*/false)
                                            : detail::rowwise_layout(/*linear=*/true));
      if (i == 0) {
        detail::hooks_of(linear)->register_forward_pre_hook(
            [mesh](torch::nn::Module&, ModuleCall& call) {
              TORCH_CHECK(!call.args.empty() && call.args[0].isTensor(),
                          "Tensor parallel module expects torch.Tensor or DTensor input");
              call.args[0] = make_input_replicate_1d(call.args[0].toTensor(), mesh);
            });
      }
      if (i == n - 1) {
        detail::hooks_of(linear)->register_forward_hook(
            [mesh](torch::nn::Module&, const ModuleCall&, c10::IValue& out) {
              out = make_output_tensor(out.toTensor(), mesh);
            });
      }
    }
  }
}

}  // namespace dtensor::tp
