#pragma once
// Expert parallelism (torchtitan's ExpertParallel): each rank of an "ep" mesh dimension holds
// num_experts / ep whole experts, and each token travels by all-to-all to the ranks holding its
// chosen experts and back (docs/ARCHITECTURE.md, "Expert parallelism"):
//
//   auto mesh = init_device_mesh("cpu", {2}, {"ep"});
//   tp::parallelize_module(*moe, mesh, ExpertParallel({.dispatch = MoeDispatch::kCapacity,
//                                                      .capacity_factor = 1.25}));
//   at::Tensor y = moe->forward(x);        // x: this rank's own tokens (data parallel)
//   loss.backward();
//   tp::reduce_partial_grads(*moe);        // the router's gradient summed over the ep ranks
//
// With tensor parallelism too, apply_expert_parallel on a 2-D mesh ("ep", "tp") splits each
// local expert's columns over "tp" as apply_tensor_parallel does (torchtitan's
// ExpertTensorParallel).
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/moe.h"
#include "dtensor/tp/parallel_style.h"

namespace dtensor::models {

/// How tokens reach their experts.
enum class MoeDispatch {
  /// Every choice reaches its expert: the per-expert counts are exchanged first (one all-to-all,
  /// read back to the host for the split sizes), then the rows go by an uneven all-to-all.
  kDropless,
  /// Each expert takes at most expert_capacity() rows from each rank, in fixed buffers: the
  /// all-to-alls are even, nothing is read back to the host (a CUDA graph can capture it); the
  /// choices beyond the capacity are dropped (their routing weight counts as zero).
  kCapacity,
};

/// "dropless" or "capacity"; throws naming the value otherwise.
MoeDispatch parse_moe_dispatch(const std::string& name);
/// "dropless" or "capacity".
const char* moe_dispatch_name(MoeDispatch dispatch);

/// Where the ep ranks' tokens come from.
enum class ExpertTokens {
  /// Each rank's input is its own (EP folded over data-parallel ranks), and so is its auxiliary
  /// loss.
  kOwn,
  /// The ep ranks are the tensor-parallel ranks of one model replica (torchtitan's EP folded over
  /// TP): each holds its sequence shard (sequence parallelism); the router logits are gathered
  /// so that every rank's auxiliary loss is the replica's.
  kSequenceShard,
  /// As kSequenceShard, but each rank holds all the tokens (TP without sequence parallelism):
  /// each routes its 1/ep of them and the block's output is gathered.
  kReplicated,
};

/// Options of expert parallelism.
struct ExpertParallelOptions {
  MoeDispatch dispatch = MoeDispatch::kDropless;
  /// kCapacity: each expert's rows per source rank, as a multiple of an even share.
  double capacity_factor = 1.0;
  ExpertTokens tokens = ExpertTokens::kOwn;
};

/// The rows each expert takes from one rank in capacity mode: ceil(capacity_factor * T * k / E),
/// at least 1, for T tokens routed to top_k of num_experts experts on that rank. Choices are
/// kept in token order (a token's better choice first), as GShard's per-group capacity.
int64_t expert_capacity(int64_t tokens, int64_t top_k, int64_t num_experts, double capacity_factor);

/// A MoE block's expert-parallel state (MoEImpl::expert_dispatch).
struct ExpertDispatch {
  DeviceMesh mesh;  ///< The 1-D "ep" mesh.
  ExpertParallelOptions options;
  /// The choices the last forward dropped (int64 scalar on the device; zero when dropless).
  at::Tensor last_dropped;
};

/// The block's experts for this rank's tokens x (T, H) routed by `routing`: the rows sent to
/// their experts' ranks, the local experts `w` (this rank's slice) applied, the outputs sent
/// back and combined as experts_forward combines them. Collectives on the "ep" group per call:
/// dropless 3 all-to-alls forward (counts, dispatch, combine) and 2 backward; capacity 2 and 2.
at::Tensor dispatch_to_experts(ExpertDispatch& dispatch, const at::Tensor& x,
                               const Routing& routing, const ExpertWeights& w,
                               const MoeOptions& options);

/// Gives each rank of the "ep" dimension of `mesh` num_experts / ep whole experts, in place and
/// without communication (every rank keeps its slice of its own values): the expert weights and
/// biases become DTensors Shard(0) over "ep"; the router stays replicated, its gradient Partial
/// over "ep" (each rank's tokens give part of it; reduce_partial_grads sums it). `mesh` is 1-D
/// (the ep ranks) or 2-D with dims "ep" and "tp": then each local expert is also split over "tp"
/// as apply_tensor_parallel splits it, and the block takes its input whole on the tp ranks.
/// Throws, before changing anything, when num_experts is not divisible by ep, when the
/// experts' width is not divisible by tp, or when the block is already parallelized.
void apply_expert_parallel(MoEImpl& moe, const DeviceMesh& mesh,
                           const ExpertParallelOptions& options = {});

/// apply_expert_parallel as a parallel style, for parallelize_module on a models::MoE over a 1-D
/// "ep" mesh. Its input and output are plain tensors of this rank's tokens (a DTensor input is
/// taken as its local tensor), as options.tokens says. The decoder's plan uses it for its sparse
/// layers when TensorParallelOptions::ep is the tp degree.
class ExpertParallel : public tp::ParallelStyle {
 public:
  explicit ExpertParallel(ExpertParallelOptions options = {}) : options_(options) {}
  /// "ExpertParallel(dispatch=capacity, capacity_factor=1.25)".
  std::string repr() const override;
  /// Throws unless `module` is a models::MoE whose experts divide by the mesh's ranks.
  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override;
  /// apply_expert_parallel(module, mesh, options).
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override;

 private:
  ExpertParallelOptions options_;
};

}  // namespace dtensor::models
