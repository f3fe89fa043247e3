#pragma once
// Mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral, gpt-oss): a router picks top_k of
// num_experts experts per token, each a gated MLP whose weights are stacked [E, ...], and the
// block's output is the routing-weighted sum of the chosen experts' outputs. The arithmetic
// follows transformers 5.25's (docs/ARCHITECTURE.md, "Mixtures of experts"):
//
//   MoeOptions o{.num_experts = 8, .top_k = 2, .scoring = RouterScoring::kSoftmaxThenTopK,
//                .renormalize = true};                        // Qwen3-MoE with norm_topk_prob
//   MoE moe(/*dim=*/32, /*expert_hidden_dim=*/16, o);
//   at::Tensor y = moe->forward(x);                          // x (B, S, 32) -> (B, S, 32)
//   at::Tensor aux = load_balancing_loss({moe->last_router_logits()}, 8, 2);
//
// The experts run as one grouped product per projection (at::_grouped_mm) where this LibTorch has
// the kernel for the dtype and the strides, else as a loop over the experts; both give the same
// bits (the CPU kernel multiplies each expert's rows alone). In LayoutInvariantMode each expert's
// rows are padded to detail::kInvariantMinRows, so that a token's result does not depend on how
// many other tokens chose its expert.
#include <ATen/core/Tensor.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/core/distribute_module.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/nn/layers.h"
#include "dtensor/nn/module.h"

namespace dtensor::models {

/// How a router turns its logits into the chosen experts' weights.
enum class RouterScoring {
  /// Softmax over all experts in float32 (or wider), then the top_k probabilities (Qwen3-MoE,
  /// Mixtral; transformers' Qwen3MoeTopKRouter and MixtralTopKRouter).
  kSoftmaxThenTopK,
  /// The top_k logits, then a softmax over those k in the logits' dtype (gpt-oss's
  /// GptOssTopKRouter).
  kTopKThenSoftmax,
};

/// The expert MLP's gate: act(gate) * up.
enum class ExpertActivation {
  kSwiGLU,  ///< silu(gate) * up (Qwen3-MoE, Mixtral).
  /// gpt-oss: gate clamped above at `limit`, up clamped to [-limit, limit], then
  /// (up + 1) * gate * sigmoid(alpha * gate).
  kClampedSwiGLU,
};

/// How the experts' products are computed.
enum class ExpertCompute {
  kAuto,       ///< The faster of the two where both run (see expert_compute_for).
  kGroupedMm,  ///< One at::_grouped_mm per projection over all experts' rows.
  kLoop,       ///< One at::mm per expert that has rows.
};

/// A mixture-of-experts block's configuration (the families' differences as data).
struct MoeOptions {
  int64_t num_experts = 8;  ///< Routed experts (HF num_experts / num_local_experts).
  int64_t top_k = 2;        ///< Experts per token (HF num_experts_per_tok).
  RouterScoring scoring = RouterScoring::kSoftmaxThenTopK;
  /// kSoftmaxThenTopK: the k probabilities divided by their sum (Mixtral always; Qwen3-MoE
  /// norm_topk_prob).
  bool renormalize = false;
  /// The routing weights stay float32 (Mixtral) instead of being cast back to the hidden
  /// states' dtype (Qwen3-MoE; gpt-oss's are in that dtype already).
  bool float32_weights = false;
  bool router_bias = false;  ///< The router's linear has a bias (gpt-oss).
  bool expert_bias = false;  ///< Each expert's three projections have biases (gpt-oss).
  ExpertActivation activation = ExpertActivation::kSwiGLU;
  double swiglu_alpha = 1.702;  ///< kClampedSwiGLU's sigmoid gain (HF swiglu_alpha).
  double swiglu_limit = 7.0;    ///< kClampedSwiGLU's clamp (HF swiglu_limit).
  ExpertCompute compute = ExpertCompute::kAuto;

  /// Throws naming the field when inconsistent (top_k above num_experts, ...).
  void validate() const;
};

/// Which layers of a Qwen3-MoE model are sparse: layer i is, unless it is listed in
/// mlp_only_layers, when num_experts > 0 and (i + 1) % decoder_sparse_step == 0 (transformers'
/// Qwen3MoeDecoderLayer). The others keep a dense MLP.
std::vector<bool> sparse_layers(int64_t n_layers, int64_t num_experts, int64_t decoder_sparse_step,
                                const std::vector<int64_t>& mlp_only_layers);

/// A router's decision for T tokens.
struct Routing {
  at::Tensor logits;   ///< (T, E) router logits, in the hidden states' dtype.
  at::Tensor weights;  ///< (T, k) the chosen experts' weights (see MoeOptions).
  at::Tensor experts;  ///< (T, k) int64 the chosen experts, best first.
};

/// Routes x (T, H) with the router's weight (E, H) and bias (E; undefined: none).
Routing route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
              const MoeOptions& options);

/// The experts' weights stacked over experts: w1 (gate) and w3 (up) [E, I, H], w2 (down)
/// [E, H, I], each expert's as a torch::nn::Linear holds it; biases b1, b3 [E, I] and b2 [E, H]
/// (undefined: none). Under tensor parallelism each holds this rank's columns of I.
struct ExpertWeights {
  at::Tensor w1, w2, w3;
  at::Tensor b1, b2, b3;
};

/// The compute kExpertCompute::kAuto picks for these weights and dtype: grouped where
/// at::_grouped_mm runs (float32, bfloat16 and float16 with every row stride a multiple of 16
/// bytes: H and the local I) and is not slower (bench_moe), the loop otherwise (float64, odd
/// widths) and in LayoutInvariantMode (which pads each expert's rows).
ExpertCompute expert_compute_for(const ExpertWeights& w, c10::ScalarType dtype,
                                 const MoeOptions& options);

/// The routing-weighted sum of each token's chosen experts: x (T, H) -> (T, H) in x's dtype, as
/// transformers' grouped_mm experts compute it (products per expert, biases added after them,
/// the k weighted outputs of a token summed in one reduction). With column-split experts (tensor
/// parallelism) it is this rank's part of a sum over the ranks.
at::Tensor experts_forward(const at::Tensor& x, const Routing& routing, const ExpertWeights& w,
                           const MoeOptions& options);

/// Each (token, choice) of `experts` (T, k) as a row of x (T, H), the rows grouped by expert
/// (stably: in token order): the first step of experts_forward and of the expert-parallel
/// dispatch.
struct ExpertRows {
  at::Tensor sorted_ids;  ///< (T * k) the rows' experts, ascending.
  at::Tensor perm;        ///< (T * k) row i is choice perm[i], of token perm[i] / k.
  at::Tensor rows;        ///< (T * k, H) x's rows in that order.
};
/// x's rows for the choices `experts` (T, k), grouped by expert.
ExpertRows rows_by_expert(const at::Tensor& x, const at::Tensor& experts);

/// The last step of experts_forward: the experts' outputs `out` (T * k, H), in `rows`' order, times
/// their routing weights, back in token order, each token's k outputs summed in one reduction,
/// in `dtype`.
at::Tensor combine_expert_rows(const at::Tensor& out, const ExpertRows& rows,
                               const Routing& routing, c10::ScalarType dtype);

/// The expert MLP's middle, act(gate) * up, as options.activation says.
at::Tensor expert_activation(const at::Tensor& gate, const at::Tensor& up,
                             const MoeOptions& options);

/// How many of the T * k choices went to each expert: (E) int64, no gradient.
at::Tensor tokens_per_expert(const at::Tensor& experts, int64_t num_experts);

/// transformers' load_balancing_loss_func (Switch Transformer's auxiliary loss) over the sparse
/// layers' router logits, each (T, E): with f_e the fraction of all layers' top_k choices that
/// went to expert e and P_e the mean over all layers' tokens of its softmax probability,
/// E * sum_e f_e * P_e. Computed in float32 (float64 for float64 logits); differentiable through
/// the probabilities. The training loss adds router_aux_loss_coef times it.
///
/// With `data_parallel` (the 1-D mesh whose ranks each run their own part of the batch and
/// average their gradients: FSDP's or replication's "dp"), the choices, the probability sums and
/// the rows are summed over its ranks first (one all-reduce of 2E + 1 values), so that every
/// rank's value is the whole batch's, as one device computes it. The gradient reaches this rank's
/// own tokens only, times the ranks: the data-parallel average of the gradients then gives one
/// device's. No collective in the backward.
at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts,
                               int64_t top_k,
                               const std::optional<DeviceMesh>& data_parallel = std::nullopt);

/// The stacked experts as parameters: w1, w3 (E, I, H), w2 (E, H, I), and b1, b3 (E, I), b2
/// (E, H) when options.expert_bias.
class GroupedExpertsImpl : public dtensor::nn::Module, public ParameterSwapTarget {
 public:
  GroupedExpertsImpl(int64_t dim, int64_t hidden_dim, const MoeOptions& options);
  /// The parameters as ExpertWeights (plain tensors or DTensors as registered).
  ExpertWeights weights() const;
  /// Keeps the members in step with dtensor::replace_parameter (TP, FSDP).
  void on_parameter_replaced(const std::string& name, const at::Tensor& value) override;

  at::Tensor w1, w2, w3, b1, b2, b3;  ///< Registered as parameters (biases only if set).
};
/// Module holder of GroupedExpertsImpl.
TORCH_MODULE(GroupedExperts);

struct ExpertDispatch;

/// A mixture-of-experts feed-forward: router (a Linear dim -> num_experts) and experts.
class MoEImpl : public dtensor::nn::Module {
 public:
  MoEImpl(int64_t dim, int64_t hidden_dim, MoeOptions options);
  /// x: (..., dim) -> (..., dim), plain (under tensor parallelism: whole, the same on every rank
  /// of the mesh). Keeps the router's logits (with their graph) and the tokens per expert of this
  /// call for the auxiliary loss and for statistics.
  at::Tensor forward(const at::Tensor& x);

  /// The router logits (T, E) of the last forward, for load_balancing_loss; undefined before the
  /// first. Under tensor parallelism their gradient reaches the router and the input on TP rank
  /// 0 only (the values are every rank's): each rank computes the auxiliary loss whole, and its
  /// gradient must count once in the sums over the ranks.
  const at::Tensor& last_router_logits() const { return last_router_logits_; }
  /// The tokens per expert (E) of the last forward.
  const at::Tensor& last_tokens_per_expert() const { return last_tokens_per_expert_; }

  MoeOptions options;
  dtensor::nn::Linear router{nullptr};  ///< (num_experts, dim) weight; bias as options say.
  GroupedExperts experts{nullptr};
  /// Set by apply_tensor_parallel: the 1-D mesh the block runs on.
  std::optional<DeviceMesh> tp_mesh;
  /// Set by apply_tensor_parallel: every rank holds and computes every expert whole.
  bool experts_replicated = false;
  /// Set by apply_expert_parallel (expert_parallel.h): the experts this rank holds, and how
  /// tokens reach them.
  std::shared_ptr<ExpertDispatch> expert_dispatch;

 private:
  at::Tensor last_router_logits_, last_tokens_per_expert_;
};
/// Module holder of MoEImpl.
TORCH_MODULE(MoE);

/// Options of apply_tensor_parallel for a MoE block.
struct MoeTensorParallelOptions {
  /// Every rank keeps every expert whole and computes them all, with no communication: the same
  /// bits as one device at any degree, which LayoutInvariantMode needs (at tp times the experts'
  /// memory and compute). Default: the experts split over the ranks.
  bool replicate_experts = false;
};

/// How apply_tensor_parallel splits each of GroupedExperts' parameters over "tp": the gate and up
/// columns (w1, w3, b1, b3: Shard(1)), the down projection's rows (w2: Shard(2)), b2 replicated.
const std::vector<std::pair<std::string, Placement>>& expert_tensor_parallel_placements();

/// Splits `moe`'s experts over the ranks of `mesh` (1-D, or its "tp" dim) as the Megatron plan
/// splits a dense feed-forward, in place and without communication (every rank keeps its chunk
/// of its own values): every expert's gate and up columns (w1, w3, b1, b3: Shard(1)) and its
/// down projection's rows (w2: Shard(2)); the router and b2 replicated. Measured against
/// replicating the experts in bench_moe (docs/PERFORMANCE.md, "moe — mixture-of-experts blocks
/// (issue 38)"). The forward then costs one all-reduce of the output, the backward one of the
/// input's gradient; the router's and b2's gradients are Partial (each rank's experts give part of
/// them) and summed by reduce_partial_grads. Throws unless the experts' width divides by tp.
/// LayoutInvariantMode at tp > 1 needs options.replicate_experts (forward refuses split experts
/// in it).
void apply_tensor_parallel(MoEImpl& moe, const DeviceMesh& mesh,
                           const MoeTensorParallelOptions& options = {});

}  // namespace dtensor::models
