#pragma once
// Pipeline parallelism over the "pp" dimension of a mesh (the first form of PyTorch's
// torch.distributed.pipelining): each rank of the pp dimension runs one stage of a model split
// by layers; a schedule cuts the batch into micro-batches and moves activations forward and
// their gradients backward between neighbouring stages with point-to-point sends and receives.
//
//   auto mesh = init_device_mesh("cpu", {pp, tp}, {"pp", "tp"});
//   pp::PipelineStage stage([&](const at::Tensor& x) { return module->forward(x); }, mesh);
//   pp::Schedule1F1B schedule(stage, /*n_microbatches=*/4, loss_fn);
//   opt.zero_grad();
//   at::Tensor loss = schedule.step(tokens, targets);  // defined on the last stage only
//   opt.step();
//
// Gradients accumulate over the micro-batches as for one pass over the whole batch: each
// micro-batch's loss is scaled by 1/M before its backward, so with a loss that is a mean over
// equally many elements per micro-batch the gradients equal the whole batch's. step() returns
// the mean of the micro-batch losses on the last stage.
//
// Messages per step, counted by CommDebugMode as send/recv on the pp group: for each of the
// pp - 1 stage boundaries and each of the M micro-batches, one forward activation and one
// backward gradient, each a send on one stage and a receive on the other: 2 * (pp - 1) * M
// sends and as many receives per step over the ranks of one pp group (stage s sends
// M * ([s < pp - 1] + [s > 0]) and receives as many). The first step also exchanges the
// activation shape once per boundary (one more send and receive), cached afterwards. Tied
// parameters (tie_parameter) add one send and one receive per tie on each of the two stages.
//
// Activations crossing a boundary must be plain tensors: under tensor parallelism use a plan
// without sequence parallelism at the stage boundaries, whose activations between blocks are
// replicated over tp; every tp rank of stage s then sends to the same tp rank of stage s + 1.
//
// Interleaved 1F1B (ScheduleInterleaved1F1B, Megatron-LM's and PyTorch's): the model is cut
// into v * pp stages and rank r of the pp dimension runs v of them, the "virtual stages"
// r, r + pp, r + 2 pp, ... (round-robin), so a micro-batch crosses the ranks v times and the
// bubble shrinks from (pp - 1) / (M + pp - 1) to (pp - 1) / (v M + pp - 1) when pp divides M.
// Messages: 2 * (v pp - 1) * M sends and as many receives per step over a pp group.
//
//   std::vector<pp::PipelineStage*> mine;  // PipelineStage(f_k, mesh, k * pp + r, v * pp)
//   pp::ScheduleInterleaved1F1B schedule(mine, M, loss_fn);
//
// A failure in a stage (a throwing forward, backward or loss, or a send/receive that fails)
// throws "pipeline stage S of P, forward|backward of micro-batch I: ..." and reports it to the
// other ranks (comm/failure.h), whose blocked receives and collectives then throw naming their
// own stage, micro-batch and the message they waited for.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/mesh/device_mesh.h"

namespace dtensor::pp {

/// The mesh pipeline stages run on: mesh_for_role(mesh, "pp") (dtensor/mesh/device_mesh.h), the
/// rule models::ParallelDims reads every role by: the dimension named "pp" of `mesh` (itself when
/// it is 1-D and so named), an unnamed 1-D mesh itself, else nullopt.
std::optional<DeviceMesh> get_pp_mesh(const DeviceMesh& mesh);

/// Layers [first, end) of stage `stage` of `num_stages` when `n_layers` are split as evenly as
/// possible (earlier stages take the remainder).
std::pair<int64_t, int64_t> stage_layer_range(int64_t n_layers, int64_t stage, int64_t num_stages);

/// One stage of a pipeline: this rank's part of the model, as a forward function, and its
/// place on the pp dimension (stage index = this rank's coordinate on it).
class PipelineStage {
 public:
  /// The stage's computation: the first stage gets a micro-batch of the inputs, the others the
  /// previous stage's output; it returns its output (the last stage's goes to the loss).
  using Forward = std::function<at::Tensor(const at::Tensor&)>;

  /// `mesh`: a mesh with a "pp" dimension, or the 1-D pp mesh itself (see get_pp_mesh).
  PipelineStage(Forward forward, const DeviceMesh& mesh);
  /// Stage `stage_index` of `num_stages`, a multiple of the pp degree: a virtual stage of an
  /// interleaved schedule, run by the rank whose pp coordinate is stage_index % pp.
  PipelineStage(Forward forward, const DeviceMesh& mesh, int64_t stage_index, int64_t num_stages);

  int64_t stage_index() const { return stage_; }                           ///< 0 .. num_stages - 1.
  int64_t num_stages() const { return num_stages_; }                       ///< pp * virtual stages.
  bool is_first() const { return stage_ == 0; }                            ///< Holds the inputs.
  bool is_last() const { return stage_ == num_stages() - 1; }              ///< Computes the loss.
  const DeviceMesh& pp_mesh() const { return pp_mesh_; }                   ///< The 1-D pp mesh.
  at::Tensor forward(const at::Tensor& input) { return forward_(input); }  ///< Runs the stage.
  /// The pp coordinate of the rank running stage `stage` (round-robin placement).
  int64_t rank_of(int64_t stage) const { return stage % pp_mesh_.size(); }

  /// Ties `param` (a parameter of this stage, plain or DTensor) to the parameter of stage
  /// `peer_stage` tied with this stage: after every step's backward the two stages swap their
  /// gradients and each adds the other's, so both hold the gradient of the shared weight and
  /// identical optimizer steps keep them equal (a tied embedding and output head on the first
  /// and last stage). Both stages must tie their parameters in the same order, and start with
  /// equal values.
  void tie_parameter(const at::Tensor& param, int64_t peer_stage);
  /// Swaps and sums the tied gradients (called by Schedule::step after the backward passes).
  void sync_tied_gradients();

  /// Deferred gradient synchronisation: Schedule::step calls `hook(false)` when a step begins
  /// and `hook(true)` before this stage's backward of the last micro-batch, so that a
  /// data-parallel reduction of the stage's gradients (fsdp::set_requires_gradient_sync) runs
  /// once per step, after the last micro-batch, instead of once per micro-batch.
  void set_gradient_sync_hook(std::function<void(bool)> hook) { sync_hook_ = std::move(hook); }
  /// Declares the activations that cross into this stage (`input_like`) and out of it
  /// (`output_like`) ahead of the first step: shape, dtype and device, values unused (PyTorch's
  /// PipelineStage takes input_args for the same). The first step then exchanges no shape
  /// message, like every later step. Both ends of a boundary must declare it, or neither.
  /// Needed for meta tensors, whose shape message has no values to read.
  void set_boundary_activations(std::optional<at::Tensor> input_like,
                                std::optional<at::Tensor> output_like);

  /// A label for messages: "pipeline stage 1 of 4".
  std::string label() const;

 private:
  friend class Schedule;
  Forward forward_;
  DeviceMesh pp_mesh_;
  int64_t stage_, num_stages_;
  struct Tie {
    at::Tensor param;
    int64_t peer;
  };
  std::vector<Tie> ties_;
  std::function<void(bool)> sync_hook_;
  // Shapes of the activations crossing this stage's boundaries, exchanged on the first step.
  std::optional<at::Tensor> input_like_, output_like_;
};

/// One unit of a schedule: the forward or the backward of micro-batch `microbatch` through
/// the rank's stage number `chunk` (0 unless the schedule runs several stages per rank).
struct Action {
  bool backward;       ///< Backward pass, else forward.
  int64_t microbatch;  ///< 0 .. M - 1.
  int64_t chunk = 0;   ///< Index into the schedule's stages on this rank.
  bool operator==(const Action& o) const = default;
};
/// "F0 F1 B0 B1"; when some action has a chunk other than 0, each is "F<microbatch>.<chunk>".
std::string format_actions(const std::vector<Action>& actions);

/// Loss of one micro-batch from the last stage's output and the micro-batch's targets.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

/// Time a step spent, for measuring the pipeline bubble.
struct StepTiming {
  double total_s = 0;    ///< The whole step.
  double compute_s = 0;  ///< Forward, loss and backward of the micro-batches.
};

/// A pipeline schedule: runs its actions in order, receiving each forward's input from the
/// previous stage and each backward's output gradient from the next one (blocking), and
/// sending the results on without waiting (the sends are waited for at the end of the step).
class Schedule {
 public:
  /// `n_microbatches` >= 1 splits every step's batch along dim 0 (it must divide the batch).
  /// `loss_fn` is called on the last stage only.
  Schedule(PipelineStage& stage, int64_t n_microbatches, LossFn loss_fn);
  /// Several stages on this rank (virtual stages), in the order of their stage indices.
  Schedule(std::vector<PipelineStage*> stages, int64_t n_microbatches, LossFn loss_fn);
  virtual ~Schedule() = default;
  Schedule(const Schedule&) = delete;
  Schedule& operator=(const Schedule&) = delete;

  /// One forward and backward pass over the batch: `inputs` is read on the first stage,
  /// `targets` on the last (other stages may pass undefined tensors). Gradients accumulate into
  /// the stage's parameters (zero them before, step the optimizer after). Returns the mean of
  /// the micro-batch losses (detached) on the last stage, an undefined tensor elsewhere.
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets);

  /// Forward passes only, without gradients (PyTorch's Schedule.eval): `inputs` (read on the
  /// first stage) split into `n_microbatches` micro-batches along dim 0 (0: the schedule's M),
  /// each through every stage in order. Returns the last stage's outputs joined along dim 0
  /// (undefined on the other ranks). Each stage boundary carries one shape message per call and
  /// one activation per micro-batch; call it between steps (it reuses the steps' tags).
  at::Tensor eval(const at::Tensor& inputs, int64_t n_microbatches = 0);

  /// This stage's actions in the order the schedule runs them.
  virtual std::vector<Action> actions() const = 0;
  int64_t n_microbatches() const { return n_microbatches_; }  ///< M.
  /// Timing of the last step on this rank.
  const StepTiming& last_timing() const { return timing_; }
  /// The last step's loss of each micro-batch (detached, in micro-batch order) on the last
  /// stage, empty elsewhere: for a caller that combines them its own way (step() returns their
  /// mean in the loss's dtype).
  const std::vector<at::Tensor>& microbatch_losses() const { return losses_; }
  /// Called on this rank before each of its actions runs, forward and backward alike: for state
  /// keyed by the micro-batch (dtensor_train's dropout key), which a backward's recomputation
  /// (activation checkpointing) must see as the forward did.
  void set_action_hook(std::function<void(const Action&)> hook) { action_hook_ = std::move(hook); }

 protected:
  std::vector<PipelineStage*> stages_;  ///< This rank's stages (one unless interleaved).
  PipelineStage& stage_;                ///< The first of them.
  int64_t n_microbatches_;

 private:
  LossFn loss_fn_;
  StepTiming timing_;
  std::vector<at::Tensor> losses_;
  std::function<void(const Action&)> action_hook_;
};

/// GPipe: all forwards, then all backwards. Keeps the activations of all M micro-batches.
class ScheduleGPipe : public Schedule {
 public:
  using Schedule::Schedule;
  std::vector<Action> actions() const override;
};

/// 1F1B: stage s runs min(pp - 1 - s, M) forwards, then alternates one forward and one
/// backward, then runs the remaining backwards; at most pp - s micro-batches are in flight.
class Schedule1F1B : public Schedule {
 public:
  using Schedule::Schedule;
  std::vector<Action> actions() const override;
};

/// Interleaved 1F1B over v = stages.size() virtual stages per rank (stage k of rank r is
/// k * pp + r of v * pp). Micro-batches go through in rounds of R = M / max(1, M / pp) (which
/// must divide M): a forward runs chunk (f / R) mod v, a backward chunk v - 1 - (b / R) mod v,
/// each on its next micro-batch. Rank r first runs min(v M, (v - 1) R + 2 (pp - 1 - r))
/// forwards, then alternates one forward and one backward, then runs the remaining backwards.
/// With v = 1 it is a 1F1B with a longer warm-up; pp >= 2.
class ScheduleInterleaved1F1B : public Schedule {
 public:
  ScheduleInterleaved1F1B(std::vector<PipelineStage*> stages, int64_t n_microbatches,
                          LossFn loss_fn);
  std::vector<Action> actions() const override;
  int64_t virtual_stages() const { return static_cast<int64_t>(stages_.size()); }  ///< v.
};

/// The actions of ScheduleInterleaved1F1B on pp rank `rank` of `pp`, with v virtual stages and
/// M micro-batches (throws when the rounds do not divide M).
std::vector<Action> interleaved_1f1b_actions(int64_t pp, int64_t rank, int64_t virtual_stages,
                                             int64_t n_microbatches);

/// The bubble a schedule leaves with equal stages, pp ranks, v virtual stages per rank and M
/// micro-batches: (pp - 1) / (v M + pp - 1) (v = 1 for GPipe and 1F1B).
double bubble_fraction(int64_t pp, int64_t virtual_stages, int64_t n_microbatches);

}  // namespace dtensor::pp
