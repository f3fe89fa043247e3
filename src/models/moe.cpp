// Mixture-of-experts blocks (moe.h): routing, the experts' grouped products, the auxiliary loss.
#include "dtensor/models/moe.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

#include "block_math.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/models/expert_parallel.h"
#include "dtensor/ops/layout_invariant.h"

namespace dtensor::models {

void MoeOptions::validate() const {
  TORCH_CHECK(num_experts > 0, "MoeOptions: num_experts must be positive, got ", num_experts);
  TORCH_CHECK(top_k > 0 && top_k <= num_experts, "MoeOptions: top_k (num_experts_per_tok) ", top_k,
              " must be in [1, num_experts=", num_experts, "]");
  TORCH_CHECK(swiglu_limit > 0, "MoeOptions: swiglu_limit must be positive, got ", swiglu_limit);
}

std::vector<bool> sparse_layers(int64_t n_layers, int64_t num_experts, int64_t decoder_sparse_step,
                                const std::vector<int64_t>& mlp_only_layers) {
  TORCH_CHECK(decoder_sparse_step > 0 || num_experts == 0,
              "decoder_sparse_step must be positive, got ", decoder_sparse_step);
  std::vector<bool> out(static_cast<size_t>(n_layers), false);
  for (int64_t i = 0; i < n_layers && num_experts > 0; ++i)
    out[static_cast<size_t>(i)] = (i + 1) % decoder_sparse_step == 0;
  for (int64_t i : mlp_only_layers) {
    TORCH_CHECK(i >= 0 && i < n_layers, "mlp_only_layers holds ", i, ", which is not a layer of ",
                n_layers);
    out[static_cast<size_t>(i)] = false;
  }
  return out;
}

namespace {

// float32 for half-precision and float32 logits, float64 for float64 ones: the precision the
// routers' softmax and the auxiliary loss take.
c10::ScalarType routing_precision(c10::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

Routing route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
              const MoeOptions& options) {
  TORCH_CHECK(x.dim() == 2, "route: expected hidden states (tokens, hidden), got ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1), "route: the router's weight ",
              weight.sizes(), " does not take hidden size ", x.size(1));
  Routing r;
  // In LayoutInvariantMode padded to 4 rows, as the experts' products: a token's logits are then
  // the same bits however many tokens are routed with it.
  r.logits = detail::rows_padded(x, [&](const at::Tensor& rows) {
    return bias.defined() ? at::linear(rows, weight, bias) : at::linear(rows, weight);
  });
  const int64_t k = options.top_k;
  if (options.scoring == RouterScoring::kTopKThenSoftmax) {
    auto [top, experts] = at::topk(r.logits, k, -1);
    r.weights = at::softmax(top, 1);
    r.experts = experts;
    return r;
  }
  const at::Tensor probs = at::softmax(r.logits, -1, routing_precision(r.logits.scalar_type()));
  auto [top, experts] = at::topk(probs, k, -1);
  if (options.renormalize) top = top / top.sum(-1, /*keepdim=*/true);
  r.weights = options.float32_weights ? top : top.to(r.logits.scalar_type());
  r.experts = experts;
  return r;
}

at::Tensor tokens_per_expert(const at::Tensor& experts, int64_t num_experts) {
  at::NoGradGuard no_grad;
  const at::Tensor ids = experts.reshape(-1);
  return at::zeros({num_experts}, ids.options()).index_add_(0, ids, at::ones_like(ids));
}

ExpertCompute expert_compute_for(const ExpertWeights& w, c10::ScalarType dtype,
                                 const MoeOptions& options) {
  // The mode pads each expert's rows, which the loop does expert by expert.
  if (ops::layout_invariant_segments() > 0) return ExpertCompute::kLoop;
  const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
  const c10::Device device = w.w1.device();
  bool runs = (device.is_cpu() && (dtype == at::kFloat || half)) ||
              (device.is_cuda() && dtype == at::kBFloat16);
  // The kernel needs every row stride (H of the inputs, I of the hidden rows) in whole 16 bytes.
  const int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
  runs = runs && (w.w1.size(2) * bytes) % 16 == 0 && (w.w1.size(1) * bytes) % 16 == 0;
  for (const at::Tensor* t : {&w.w1, &w.w2, &w.w3})
    runs = runs && t->is_contiguous() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0;
  if (options.compute == ExpertCompute::kGroupedMm) {
    TORCH_CHECK(runs, "MoE: the grouped product does not run on ", dtype, " experts on ", device,
                " with hidden size ", w.w1.size(2), " and expert width ", w.w1.size(1),
                " (it needs float32, bfloat16 or float16 on the CPU, bfloat16 on CUDA, and rows "
                "of whole 16 bytes)");
    return ExpertCompute::kGroupedMm;
  }
  if (options.compute == ExpertCompute::kLoop || !runs) return ExpertCompute::kLoop;
  return ExpertCompute::kGroupedMm;
}

at::Tensor expert_activation(const at::Tensor& gate, const at::Tensor& up,
                             const MoeOptions& options) {
  if (options.activation == ExpertActivation::kSwiGLU) return at::silu(gate) * up;
  // gpt-oss's GptOssExperts._apply_gate, in its order of operations.
  const double limit = options.swiglu_limit;
  const at::Tensor g = gate.clamp_max(limit);
  const at::Tensor u = up.clamp(-limit, limit);
  const at::Tensor glu = g * at::sigmoid(g * options.swiglu_alpha);
  return (u + 1) * glu;
}

namespace {

// Each expert's rows of the `rows` (token, choice) pairs, from their counts. On the meta device
// (dtensor_plan's simulated step) counts have no values: routing is taken as uniform, the rows
// spread as evenly as they go, so that the plan sees a balanced router's shapes and FLOPs.
std::vector<int64_t> expert_rows(const at::Tensor& counts, int64_t rows) {
  const int64_t E = counts.size(0);
  std::vector<int64_t> sizes(static_cast<size_t>(E));
  const at::Tensor host = counts.is_meta() ? at::Tensor() : counts.cpu();
  for (int64_t e = 0; e < E; ++e)
    sizes[static_cast<size_t>(e)] =
        host.defined() ? host[e].item<int64_t>() : rows / E + (e < rows % E ? 1 : 0);
  return sizes;
}

}  // namespace

at::Tensor experts_forward(const at::Tensor& x, const Routing& routing, const ExpertWeights& w,
                           const MoeOptions& options) {
  TORCH_CHECK(x.dim() == 2, "experts_forward: expected (tokens, hidden), got ", x.sizes());
  TORCH_CHECK(w.w1.dim() == 3 && w.w3.sizes() == w.w1.sizes() && w.w2.dim() == 3 &&
                  w.w2.size(0) == w.w1.size(0) && w.w2.size(1) == w.w1.size(2) &&
                  w.w2.size(2) == w.w1.size(1) && w.w1.size(2) == x.size(1),
              "experts_forward: expert weights w1 ", w.w1.sizes(), ", w3 ", w.w3.sizes(), ", w2 ",
              w.w2.sizes(), " do not fit hidden size ", x.size(1));
  const int64_t E = w.w1.size(0);
  const ExpertRows grouped = rows_by_expert(x, routing.experts);
  const at::Tensor& sorted_ids = grouped.sorted_ids;
  const at::Tensor& rows = grouped.rows;
  const at::Tensor counts = tokens_per_expert(sorted_ids, E);

  const ExpertCompute compute = expert_compute_for(w, x.scalar_type(), options);
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> product;
  if (compute == ExpertCompute::kGroupedMm) {
    const at::Tensor offsets = at::cumsum(counts, 0, at::kInt);
    product = [offsets](const at::Tensor& a, const at::Tensor& weight) {
      return at::_grouped_mm(a, weight.transpose(-2, -1), offsets);
    };
  } else {
    product = [sizes = expert_rows(counts, rows.size(0))](const at::Tensor& a,
                                                          const at::Tensor& weight) {
      // unbind, not select per expert: select's backward writes each expert's gradient into a
      // zero tensor of all experts' size, unbind's stacks them once.
      const std::vector<at::Tensor> experts = weight.unbind(0);
      std::vector<at::Tensor> parts;
      int64_t start = 0;
      for (size_t e = 0; e < sizes.size(); ++e) {
        if (sizes[e] == 0) continue;
        const at::Tensor we = experts[e].t();
        // In LayoutInvariantMode an expert's 1-3 rows are padded to 4 (another kernel path below).
        parts.push_back(detail::rows_padded(a.narrow(0, start, sizes[e]),
                                            [&](const at::Tensor& r) { return at::mm(r, we); }));
        start += sizes[e];
      }
      if (parts.empty()) return at::empty({0, weight.size(1)}, a.options());
      return at::cat(parts);
    };
  }
  // Biases are added after the products, row by row, as transformers adds them.
  auto with_bias = [&](at::Tensor out, const at::Tensor& bias) {
    return bias.defined() ? out + bias.index_select(0, sorted_ids) : out;
  };
  const at::Tensor gate = with_bias(product(rows, w.w1), w.b1);
  const at::Tensor up = with_bias(product(rows, w.w3), w.b3);
  const at::Tensor out = with_bias(product(expert_activation(gate, up, options), w.w2), w.b2);
  return combine_expert_rows(out, grouped, routing, x.scalar_type());
}

ExpertRows rows_by_expert(const at::Tensor& x, const at::Tensor& experts) {
  // Each (token, choice) pair becomes a row; rows are grouped by expert (stable: in token order).
  auto [sorted_ids, perm] =
      at::sort(experts.reshape(-1), /*stable=*/true, /*dim=*/0, /*descending=*/false);
  at::Tensor rows = x.index_select(0, at::floor_divide(perm, experts.size(1)));
  return {std::move(sorted_ids), std::move(perm), std::move(rows)};
}

at::Tensor combine_expert_rows(const at::Tensor& out, const ExpertRows& rows,
                               const Routing& routing, c10::ScalarType dtype) {
  const at::Tensor& perm = rows.perm;
  const int64_t T = routing.experts.size(0), k = routing.experts.size(1);
  const at::Tensor weighted = out * routing.weights.reshape(-1).index_select(0, perm).unsqueeze(-1);
  // Back to (token, choice) order, then each token's k outputs summed in one reduction.
  const at::Tensor inverse =
      at::empty_like(perm).index_put_({perm}, at::arange(perm.size(0), perm.options()));
  return weighted.index_select(0, inverse).view({T, k, -1}).sum(1).to(dtype);
}

at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts,
                               int64_t top_k, const std::optional<DeviceMesh>& data_parallel) {
  TORCH_CHECK(!router_logits.empty(), "load_balancing_loss: no router logits");
  const c10::ScalarType acc = routing_precision(router_logits.front().scalar_type());
  const auto options = router_logits.front().options().dtype(acc);
  at::Tensor choices = at::zeros({num_experts}, options);
  at::Tensor probabilities = at::zeros({num_experts}, options);
  double rows = 0;
  // transformers' order of operations: per layer a softmax in the logits' dtype and its top_k,
  // the counts and the probabilities summed over layers, each divided by all layers' rows.
  for (const at::Tensor& logits : router_logits) {
    TORCH_CHECK(logits.dim() == 2 && logits.size(1) == num_experts,
                "load_balancing_loss: router logits must be (tokens, ", num_experts, "), got ",
                logits.sizes());
    const at::Tensor p = at::softmax(logits, -1);
    const at::Tensor chosen = std::get<1>(at::topk(p, top_k, -1));
    choices = choices + tokens_per_expert(chosen, num_experts).to(acc);
    probabilities = probabilities + p.to(acc).sum(0);
    rows += static_cast<double>(logits.size(0));
  }
  at::Tensor f, P;
  if (data_parallel && data_parallel->size() > 1) {
    TORCH_CHECK(data_parallel->ndim() == 1,
                "load_balancing_loss: the data-parallel mesh must be 1-D, got ",
                data_parallel->str());
    // The whole batch's sums; the gradient stays this rank's (its tokens' part of one device's)
    // times the ranks, which the gradients' average over them divides back. The rows stay a
    // tensor: no value is read, so that dtensor_plan's meta step runs it too.
    const at::Tensor pooled =
        comm::all_reduce(at::cat({choices, probabilities.detach(), at::full({1}, rows, options)}),
                         ReduceOp::Sum, data_parallel->group(0));
    const auto ranks = static_cast<double>(data_parallel->size());
    const at::Tensor all_rows = pooled.narrow(0, 2 * num_experts, 1);
    f = pooled.narrow(0, 0, num_experts) / all_rows;
    P = (pooled.narrow(0, num_experts, num_experts) +
         (probabilities - probabilities.detach()) * ranks) /
        all_rows;
  } else {
    f = choices / rows;
    P = probabilities / rows;
  }
  return (f * P.unsqueeze(0)).sum() * num_experts;
}

// ---- modules ----

GroupedExpertsImpl::GroupedExpertsImpl(int64_t dim, int64_t hidden_dim, const MoeOptions& options) {
  options.validate();
  const int64_t E = options.num_experts;
  // nn.Linear's default bounds per expert; the decoder initialises by name instead.
  auto uniform = [](std::vector<int64_t> shape, int64_t fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    return at::empty(shape).uniform_(-bound, bound);
  };
  w1 = register_parameter("w1", uniform({E, hidden_dim, dim}, dim));
  w2 = register_parameter("w2", uniform({E, dim, hidden_dim}, hidden_dim));
  w3 = register_parameter("w3", uniform({E, hidden_dim, dim}, dim));
  if (options.expert_bias) {
    b1 = register_parameter("b1", at::zeros({E, hidden_dim}));
    b2 = register_parameter("b2", at::zeros({E, dim}));
    b3 = register_parameter("b3", at::zeros({E, hidden_dim}));
  }
}

ExpertWeights GroupedExpertsImpl::weights() const { return {w1, w2, w3, b1, b2, b3}; }

void GroupedExpertsImpl::on_parameter_replaced(const std::string& name, const at::Tensor& value) {
  at::Tensor* members[] = {&w1, &w2, &w3, &b1, &b2, &b3};
  const char* names[] = {"w1", "w2", "w3", "b1", "b2", "b3"};
  for (int i = 0; i < 6; ++i)
    if (name == names[i]) *members[i] = value;
}

MoEImpl::MoEImpl(int64_t dim, int64_t hidden_dim, MoeOptions options_)
    : options(std::move(options_)) {
  options.validate();
  router = register_module(
      "router", dtensor::nn::Linear(
                    torch::nn::LinearOptions(dim, options.num_experts).bias(options.router_bias)));
  experts = register_module("experts", GroupedExperts(dim, hidden_dim, options));
}

namespace {

// A parameter's local value whose gradient is Partial over the mesh dims it is replicated on:
// under tensor parallelism each rank's expert columns give part of it, under expert
// parallelism each rank's tokens (summed by reduce_partial_grads).
at::Tensor with_partial_grad(const at::Tensor& p) {
  if (!p.defined() || !is_dtensor(p)) return p;
  std::vector<Placement> grad;
  for (const Placement& pl : placements(p)) grad.push_back(pl.is_replicate() ? Partial() : pl);
  return to_local(p, grad);
}

at::Tensor local_of(const at::Tensor& p) {
  if (!p.defined() || !is_dtensor(p)) return p;
  return to_local(p);
}

}  // namespace

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  return call_forward(
      [this](const at::Tensor& x) {
        at::Tensor flat = x.reshape({-1, x.size(-1)});
        if (!tp_mesh && !expert_dispatch) {
          const Routing routing = route(flat, router->weight, router->bias, options);
          last_router_logits_ = routing.logits;
          last_tokens_per_expert_ = tokens_per_expert(routing.experts, options.num_experts);
          return experts_forward(flat, routing, experts->weights(), options).view(x.sizes());
        }
        if (experts_replicated) {
          // Every rank computes the whole block from the same values: nothing to communicate.
          const ExpertWeights w = experts->weights();
          const Routing routing =
              route(flat, local_of(router->weight), local_of(router->bias), options);
          last_router_logits_ = routing.logits;
          last_tokens_per_expert_ = tokens_per_expert(routing.experts, options.num_experts);
          const ExpertWeights local{local_of(w.w1), local_of(w.w2), local_of(w.w3),
                                    local_of(w.b1), local_of(w.b2), local_of(w.b3)};
          return experts_forward(flat, routing, local, options).view(x.sizes());
        }
        const int64_t tp = tp_mesh ? tp_mesh->size() : 1;
        TORCH_CHECK(tp == 1 || ops::layout_invariant_segments() == 0,
                    "MoE: LayoutInvariantMode with experts split over tp=", tp,
                    " ranks is not built (the down projections' sums over the split columns "
                    "would need the mode's canonical order); replicate the experts "
                    "(MoeTensorParallelOptions::replicate_experts)");
        // EP folded over TP ranks: the ranks share one replica's tokens and its auxiliary loss.
        const ExpertDispatch* shared =
            expert_dispatch && expert_dispatch->options.tokens != ExpertTokens::kOwn
                ? expert_dispatch.get()
                : nullptr;
        const bool tp_first = !tp_mesh || tp_mesh->get_local_rank() == 0;
        const bool first = shared ? shared->mesh.get_local_rank() == 0 : tp_first;
        const bool split = shared && shared->options.tokens == ExpertTokens::kReplicated;
        if (split) {
          // Every rank holds all the tokens and routes its 1/ep of them: the input's gradient is
          // each rank's rows, all-reduced on the way back.
          const DeviceMesh& m = shared->mesh;
          TORCH_CHECK(flat.size(0) % m.size() == 0, "MoE: ", flat.size(0),
                      " tokens do not split over ep=", m.size(), " ranks");
          flat = to_local(from_local(flat, m, {Replicate()}), std::vector<Placement>{Partial()})
                     .chunk(m.size())[m.get_local_rank()];
        }
        // The input enters whole; its gradient is each rank's part (its experts' columns), so it
        // is all-reduced on the way back (from_local of a Replicate with a Partial gradient).
        if (tp_mesh)
          flat = to_local(from_local(flat, *tp_mesh, {Replicate()}),
                          std::vector<Placement>{Partial()});
        const Routing routing = route(flat, with_partial_grad(router->weight),
                                      with_partial_grad(router->bias), options);
        // Every rank computes the auxiliary loss whole: its gradient counts on rank 0 only.
        at::Tensor logits = routing.logits;
        if (shared)  // all the replica's logits; rank 0's gradient reduce-scattered back
          logits =
              to_local(redistribute(from_local(logits, shared->mesh, {Shard(0)}), {Replicate()}),
                       std::vector<Placement>{Partial()});
        last_router_logits_ = first ? logits : logits.detach() + (logits - logits.detach()) * 0;
        last_tokens_per_expert_ = tokens_per_expert(routing.experts, options.num_experts);
        const ExpertWeights w = experts->weights();
        // b2 counts once in the sum over the ranks: rank 0 adds it, the others add zeros (so
        // every rank has its Partial gradient, as reduce_partial_grads needs).
        at::Tensor b2 = with_partial_grad(w.b2);
        if (b2.defined() && !tp_first) b2 = b2 * 0;
        const ExpertWeights local{
            local_of(w.w1), local_of(w.w2), local_of(w.w3), local_of(w.b1), b2, local_of(w.b3)};
        // This rank's part of the sum over the experts' columns; under expert parallelism the
        // tokens travel to the ranks holding their experts and back.
        const at::Tensor part =
            expert_dispatch ? dispatch_to_experts(*expert_dispatch, flat, routing, local, options)
                            : experts_forward(flat, routing, local, options);
        if (split)
          return to_local(redistribute(from_local(part, shared->mesh, {Shard(0)}), {Replicate()}))
              .view(x.sizes());
        if (!tp_mesh) return part.view(x.sizes());
        return to_local(redistribute(from_local(part, *tp_mesh, {Partial()}), {Replicate()}))
            .view(x.sizes());
      },
      x);
}

const std::vector<std::pair<std::string, Placement>>& expert_tensor_parallel_placements() {
  static const std::vector<std::pair<std::string, Placement>> placements{
      {"w1", Shard(1)}, {"w3", Shard(1)}, {"w2", Shard(2)},
      {"b1", Shard(1)}, {"b3", Shard(1)}, {"b2", Replicate()}};
  return placements;
}

void apply_tensor_parallel(MoEImpl& moe, const DeviceMesh& mesh_,
                           const MoeTensorParallelOptions& tp_options) {
  const DeviceMesh mesh = mesh_.ndim() == 1 ? mesh_ : mesh_["tp"];
  const int64_t tp = mesh.size(), width = moe.experts->w1.size(1);
  const bool replicate = tp_options.replicate_experts;
  TORCH_CHECK(replicate || width % tp == 0, "MoE: the experts' width ", width,
              " is not divisible by tp=", tp, " (each rank keeps whole columns of every expert)");
  at::NoGradGuard no_grad;
  auto spread = [&](const at::Tensor& p, Placement placement) {
    return distribute_tensor(p, mesh, {placement}, /*src_data_rank=*/std::nullopt)
        .requires_grad_(p.requires_grad());
  };
  GroupedExpertsImpl& e = *moe.experts;
  for (const auto& [name, placement] : expert_tensor_parallel_placements()) {
    const auto params = e.named_parameters(/*recurse=*/false);
    if (const at::Tensor* p = params.find(name))
      replace_parameter(e, name, spread(*p, replicate ? Replicate() : placement));
  }
  for (at::Tensor* p : {&moe.router->weight, &moe.router->bias}) {
    if (!p->defined()) continue;
    replace_parameter(*moe.router, p == &moe.router->weight ? "weight" : "bias",
                      spread(*p, Replicate()));
  }
  moe.tp_mesh = mesh;
  moe.experts_replicated = replicate;
}

}  // namespace dtensor::models
