// Expert parallelism (expert_parallel.h): the experts sharded over "ep", tokens dispatched to
// them and combined back by all-to-all.
#include "dtensor/models/expert_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/ops/layout_invariant.h"
#include "dtensor/tp/module_hooks.h"

namespace dtensor::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What an all-to-all of rows needs besides its tensor: the group and both ways' split sizes.
struct RowExchange : torch::CustomClassHolder {
  std::shared_ptr<comm::ProcessGroup> pg;
  std::vector<int64_t> received, sent;  // rows from / to each group rank
};

// Rows to and from every rank of a group; its backward sends the gradients the other way.
struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static variable_list forward(AutogradContext* ctx, c10::IValue exchange, const at::Tensor& x) {
    const auto& e = *static_cast<const RowExchange*>(exchange.toCapsule().get());
    at::Tensor out = comm::all_to_all_single(x, e.received, e.sent, *e.pg);
    ctx->saved_data["exchange"] = std::move(exchange);
    return {out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& e = *static_cast<const RowExchange*>(ctx->saved_data["exchange"].toCapsule().get());
    return {at::Tensor(),
            comm::all_to_all_single(grads[0].contiguous(), e.sent, e.received, *e.pg)};
  }
};

at::Tensor exchange_rows(const at::Tensor& rows, const DeviceMesh& mesh,
                         std::vector<int64_t> received, std::vector<int64_t> sent) {
  auto e = c10::make_intrusive<RowExchange>();
  e->pg = mesh.get_group(0);
  e->received = std::move(received);
  e->sent = std::move(sent);
  return AllToAllRows::apply(
      c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(std::move(e))),
      rows)[0];
}

// Dropless: the counts first, then exactly the rows each expert gets.
at::Tensor dropless(ExpertDispatch& d, const at::Tensor& x, const Routing& routing,
                    const ExpertWeights& w, const MoeOptions& options) {
  d.last_dropped = at::zeros({}, routing.experts.options());
  const int64_t ep = d.mesh.size();
  if (ep == 1) return experts_forward(x, routing, w, options);
  const int64_t E = options.num_experts, local_experts = E / ep;
  const ExpertRows grouped = rows_by_expert(x, routing.experts);
  // Rows grouped by expert are grouped by the rank holding it: block j goes to rank j.
  const at::Tensor counts = tokens_per_expert(grouped.sorted_ids, E).view({ep, local_experts});
  // arrived[j][l]: the rows rank j sends for this rank's l-th expert.
  const at::Tensor arrived = comm::all_to_all_single(counts, 0, 0, d.mesh.group(0));
  // The one read back to the host: the split sizes of both ways.
  const at::Tensor splits = at::cat({counts.sum(1), arrived.sum(1)}).cpu();
  const auto* s = splits.data_ptr<int64_t>();
  std::vector<int64_t> sent(s, s + ep), received(s + ep, s + 2 * ep);
  int64_t total = 0;
  for (int64_t r : received) total += r;
  const at::Tensor rows = exchange_rows(grouped.rows, d.mesh, received, sent);
  // Each arrived row's expert among this rank's: by source rank, then by expert.
  const at::Tensor local_ids = at::repeat_interleave(
      at::arange(local_experts, arrived.options()).repeat({ep}), arrived.reshape(-1), 0, total);
  // The local experts as one device runs them, each row once with weight one.
  const Routing local{at::Tensor(), at::ones({total, 1}, x.options()), local_ids.unsqueeze(1)};
  const at::Tensor out = experts_forward(rows, local, w, options);
  return combine_expert_rows(exchange_rows(out, d.mesh, sent, received), grouped, routing,
                             x.scalar_type());
}

// Capacity: every (source rank, expert) pair has `capacity` slots; no host read.
at::Tensor with_capacity(ExpertDispatch& d, const at::Tensor& x, const Routing& routing,
                         const ExpertWeights& w, const MoeOptions& options) {
  const int64_t ep = d.mesh.size(), E = options.num_experts, local_experts = E / ep;
  const int64_t T = x.size(0), k = routing.experts.size(1), H = x.size(1);
  const int64_t C = expert_capacity(T, k, E, d.options.capacity_factor);
  const ExpertRows grouped = rows_by_expert(x, routing.experts);
  const at::Tensor& ids = grouped.sorted_ids;
  const at::Tensor counts = tokens_per_expert(ids, E);
  // A row's place among its expert's rows (in token order); the first C are kept.
  const at::Tensor position = at::arange(ids.size(0), ids.options()) -
                              (at::cumsum(counts, 0) - counts).index_select(0, ids);
  const at::Tensor kept = position < C;
  d.last_dropped = at::logical_not(kept).sum();
  // Slot of each kept row in the send buffer [E, C] (expert-major: rank j's experts are block
  // j); dropped rows go to one spare slot past the end, never sent.
  const at::Tensor slot = at::where(kept, ids * C + position, at::full_like(ids, E * C));
  const at::Tensor buffer = at::zeros({E * C + 1, H}, x.options()).index_add(0, slot, grouped.rows);
  const std::vector<int64_t> even(static_cast<size_t>(ep), local_experts * C);
  at::Tensor arrived = buffer.narrow(0, 0, E * C);
  if (ep > 1) arrived = exchange_rows(arrived, d.mesh, even, even);
  // [source rank, local expert, slot] -> [local expert, source rank x slot]: one batched
  // product per projection over the local experts.
  const at::Tensor in =
      arrived.view({ep, local_experts, C, H}).transpose(0, 1).reshape({local_experts, ep * C, H});
  auto product = [](const at::Tensor& a, const at::Tensor& weight, const at::Tensor& bias) {
    const at::Tensor out = at::bmm(a, weight.transpose(1, 2));
    return bias.defined() ? out + bias.unsqueeze(1) : out;
  };
  const at::Tensor gate = product(in, w.w1, w.b1), up = product(in, w.w3, w.b3);
  const at::Tensor out = product(expert_activation(gate, up, options), w.w2, w.b2);
  at::Tensor back =
      out.view({local_experts, ep, C, H}).transpose(0, 1).reshape({ep * local_experts * C, H});
  if (ep > 1) back = exchange_rows(back, d.mesh, even, even);
  // The spare slot reads zeros: a dropped choice adds nothing to its token.
  const at::Tensor rows = at::cat({back, at::zeros({1, H}, back.options())}).index_select(0, slot);
  return combine_expert_rows(rows, grouped, routing, x.scalar_type());
}

}  // namespace

MoeDispatch parse_moe_dispatch(const std::string& name) {
  if (name == "dropless") return MoeDispatch::kDropless;
  if (name == "capacity") return MoeDispatch::kCapacity;
  TORCH_CHECK(false, "unknown MoE dispatch '", name, "' (expected dropless or capacity)");
}

const char* moe_dispatch_name(MoeDispatch dispatch) {
  return dispatch == MoeDispatch::kCapacity ? "capacity" : "dropless";
}

int64_t expert_capacity(int64_t tokens, int64_t top_k, int64_t num_experts,
                        double capacity_factor) {
  TORCH_CHECK(capacity_factor > 0, "MoE: the capacity factor must be positive, got ",
              capacity_factor);
  const double share = static_cast<double>(tokens * top_k) / static_cast<double>(num_experts);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(capacity_factor * share)));
}

at::Tensor dispatch_to_experts(ExpertDispatch& d, const at::Tensor& x, const Routing& routing,
                               const ExpertWeights& w, const MoeOptions& options) {
  const int64_t ep = d.mesh.size();
  TORCH_CHECK(w.w1.size(0) * ep == options.num_experts, "MoE: this rank holds ", w.w1.size(0),
              " experts, expected num_experts ", options.num_experts, " / ep ", ep);
  TORCH_CHECK(ops::layout_invariant_segments() == 0 || ep == 1,
              "MoE: LayoutInvariantMode with experts over ep=", ep,
              " ranks is not built (an expert's rows would arrive in a layout-dependent order)");
  return d.options.dispatch == MoeDispatch::kCapacity ? with_capacity(d, x, routing, w, options)
                                                      : dropless(d, x, routing, w, options);
}

void apply_expert_parallel(MoEImpl& moe, const DeviceMesh& mesh,
                           const ExpertParallelOptions& options) {
  TORCH_CHECK(mesh.ndim() == 1 || mesh.ndim() == 2,
              "apply_expert_parallel: expected a 1-D \"ep\" mesh or a 2-D (\"ep\", \"tp\") mesh, "
              "got ",
              mesh.str());
  const DeviceMesh ep_mesh = mesh.ndim() == 1 ? mesh : mesh["ep"];
  const std::optional<DeviceMesh> tp_mesh =
      mesh.ndim() == 1 ? std::nullopt : std::optional<DeviceMesh>(mesh["tp"]);
  const int64_t ep = ep_mesh.size(), tp = tp_mesh ? tp_mesh->size() : 1;
  const int64_t E = moe.options.num_experts, width = moe.experts->w1.size(1);
  TORCH_CHECK(!moe.tp_mesh && !moe.expert_dispatch,
              "apply_expert_parallel: the MoE block is already parallelized");
  TORCH_CHECK(E % ep == 0, "MoE: num_experts ", E, " is not divisible by ep=", ep,
              " (each rank holds num_experts / ep whole experts)");
  TORCH_CHECK(width % tp == 0, "MoE: the experts' width ", width, " is not divisible by tp=", tp,
              " (each rank keeps whole columns of its experts)");
  (void)expert_capacity(1, 1, 1, options.capacity_factor);  // refuses a bad factor up front
  at::NoGradGuard no_grad;
  const int64_t ep_dim = mesh.ndim() == 1 ? 0 : mesh.dim_index("ep");
  // The placements over `mesh` of a parameter that is `ep_placement` over "ep" and
  // `tp_placement` over "tp".
  auto spread = [&](const at::Tensor& p, Placement ep_placement, Placement tp_placement) {
    std::vector<Placement> pl(static_cast<size_t>(mesh.ndim()), tp_placement);
    pl[static_cast<size_t>(ep_dim)] = ep_placement;
    return distribute_tensor(p, mesh, pl, /*src_data_rank=*/std::nullopt)
        .requires_grad_(p.requires_grad());
  };
  GroupedExpertsImpl& e = *moe.experts;
  for (const auto& [name, placement] : expert_tensor_parallel_placements()) {
    const auto params = e.named_parameters(/*recurse=*/false);
    if (const at::Tensor* p = params.find(name))
      replace_parameter(e, name, spread(*p, Shard(0), placement));
  }
  for (at::Tensor* p : {&moe.router->weight, &moe.router->bias}) {
    if (!p->defined()) continue;
    replace_parameter(*moe.router, p == &moe.router->weight ? "weight" : "bias",
                      spread(*p, Replicate(), Replicate()));
  }
  moe.tp_mesh = tp_mesh;
  moe.expert_dispatch = std::make_shared<ExpertDispatch>(ExpertDispatch{ep_mesh, options, {}});
}

std::string ExpertParallel::repr() const {
  return c10::str("ExpertParallel(dispatch=", moe_dispatch_name(options_.dispatch),
                  ", capacity_factor=", options_.capacity_factor, ")");
}

void ExpertParallel::validate(torch::nn::Module& module, const std::string& fqn,
                              const DeviceMesh& mesh) const {
  const auto* moe = dynamic_cast<MoEImpl*>(&module);
  TORCH_CHECK(moe != nullptr, repr(), " at '", fqn, "' needs a models::MoE, got ", module.name());
  TORCH_CHECK(moe->options.num_experts % mesh.size() == 0, repr(), " at '", fqn, "': num_experts ",
              moe->options.num_experts, " is not divisible by ep=", mesh.size());
}

void ExpertParallel::apply(torch::nn::Module& module, const std::string& fqn,
                           const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  auto& moe = dynamic_cast<MoEImpl&>(module);
  apply_expert_parallel(moe, mesh, options_);
  moe.register_forward_pre_hook([](torch::nn::Module&, tp::ModuleCall& call) {
    const at::Tensor x = call.args.at(0).toTensor();
    if (is_dtensor(x)) call.args[0] = to_local(x);
  });
}

}  // namespace dtensor::models
