#pragma once
// The parallel degrees of a run, the one place that knows which mesh dimension plays which role
// and which layouts the library composes (torchtitan's ParallelDims). dtensor_train and
// dtensor_plan resolve their flags into one, validate it, and build the mesh from it;
// models::parallelize reads the roles of any mesh through it.
//
//   ParallelDims dims{.dp_shard = 2, .tp = -1, .pp = 2, .world_size = 8};  // tp: the rest (2)
//   dims = dims.resolved();
//   dims.validate(config, run);                   // every compatibility rule, before any work
//   DeviceMesh mesh = dims.build_mesh("cpu");     // dims "pp", "dp", "tp" (those in use)
//   DeviceMesh tp_mesh = *dims.mesh("tp");
//
// Degrees: pp (pipeline stages), dp_replicate (plain data parallelism: replicas whose gradients
// are averaged), dp_shard (FSDP: ranks that shard the parameters), cp (context parallelism: the
// sequence split over ranks, src/cp; with tp and dp_shard so far), tp (tensor parallelism), ep
// (expert parallelism: folded over the tp ranks so far). The dense layout is pp x dp_replicate x
// dp_shard x cp x tp = world_size ranks, in that order (tp innermost, so that a TP group is
// neighbouring ranks). Experts do not add ranks: ep folds over the dp_shard x cp x tp ranks of a
// pipeline stage and replica (torchtitan's sparse mesh [dp_replicate, efsdp, ep] with efsdp x ep =
// dp_shard x cp x tp), so ep must divide that product.
//
// Mesh dimension names: "pp", "dp" (the data-parallel dimension: replicated or sharded, whichever
// is in use), "cp", "tp"; a dimension of one rank is left out, except "tp", which the plans
// address. Roles (mesh()): "pp", "dp", "dp_replicate", "dp_shard", "cp", "tp", "ep".
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/mesh/device_mesh.h"

namespace dtensor::models {

struct DecoderConfig;
struct TrainingOptions;

/// The layout-invariant mode's training (ops::LayoutInvariantMode) cuts each global batch into
/// this many segments whatever the layout, each a forward and backward of its own; so it also
/// covers FSDP over at most this many ranks (nn::utils::clip_grad_norm_'s blocks allow dp of 2).
inline constexpr int64_t kLayoutInvariantBatchSegments = 2;

/// The degrees of each parallelism of a run over world_size ranks (see the top of this file).
struct ParallelDims {
  int64_t dp_replicate = 1;  ///< Plain data parallelism: replicas averaging their gradients.
  int64_t dp_shard = 1;      ///< FSDP: ranks sharding the parameters (fully_shard).
  int64_t cp = 1;            ///< Context parallelism: the sequence split over ranks.
  int64_t tp = 1;            ///< Tensor parallelism.
  int64_t pp = 1;            ///< Pipeline stages.
  /// Expert parallelism, folded over dp_shard x cp x tp: num_experts must divide by it
  /// (validate(model, run)); the decoder's plan folds it over the tp ranks only yet (ep == tp).
  int64_t ep = 1;
  /// Ranks in all. One degree (not ep) may be -1 until resolved(): the ranks the others leave.
  int64_t world_size = 1;
  /// The mesh the roles are read from: set by build_mesh() or from_mesh().
  std::optional<DeviceMesh> world_mesh;

  /// The ranks that split each batch: dp_replicate x dp_shard.
  int64_t dp() const { return dp_replicate * dp_shard; }
  /// dp_shard x cp x tp: the ranks expert parallelism folds over (efsdp x ep).
  int64_t expert_fold() const { return dp_shard * cp * tp; }

  /// A copy whose -1 degree (if any) is world_size divided by the others; throws when they do
  /// not divide it. Then validate()s the degrees.
  ParallelDims resolved() const;

  /// The degrees alone: each at least 1, their product world_size, ep dividing the ranks it folds
  /// over, and what is not built yet (cp with dp_replicate or pp, dp_replicate with dp_shard)
  /// refused with where it will go. Throws naming the degree.
  void validate() const;
  /// validate() and every rule of composing these degrees with a model and a run's options
  /// (tensor parallelism's divisibility, sequence parallelism, pipeline stages and micro-batches,
  /// FSDP's mixed precision, the layout-invariant mode's coverage, ...): throws the first broken
  /// rule, naming the degree or option and the fix. Pure: every rank refuses alike.
  void validate(const DecoderConfig& model, const TrainingOptions& run) const;

  /// The mesh of the degrees (dims as at the top of this file) on `device_type` ("cpu",
  /// "cuda", "meta"); remembered as world_mesh. Collective: every rank builds it.
  DeviceMesh build_mesh(const std::string& device_type = "cpu");

  /// The 1-D mesh playing `role` in world_mesh (mesh_for_role's rule: its dimension of that
  /// name, "dp" for "dp_replicate" and "dp_shard"), when its size is the role's degree; nullopt
  /// when world_mesh has none. Throws for an unknown role or before a mesh is set.
  std::optional<DeviceMesh> mesh(const std::string& role) const;

  /// The degrees `mesh` lays out, read from its dimension names (mesh_for_role's rule): "dp" is
  /// dp_shard when `dp_shards` (FSDP) and dp_replicate otherwise; a 1-D mesh without names is
  /// `unnamed_role`; dimensions of other names are the caller's own and ignored.
  static ParallelDims from_mesh(const DeviceMesh& mesh, bool dp_shards = false,
                                const std::string& unnamed_role = "tp");

  /// The roles mesh() knows: "pp", "dp", "dp_replicate", "dp_shard", "cp", "tp", "ep".
  static const std::vector<std::string>& roles();
};

}  // namespace dtensor::models
