#pragma once
// Everything a run needs, resolved from the options: the model config (preset, JSON file,
// overrides), the per-preset training defaults, the mesh shape and checks that the model
// splits over it. Resolving is pure (no communication), so every rank gets the same result
// and the same error message.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

#include "dtensor/models/parallel_dims.h"
#include "dtensor/models/parallelize.h"
#include "dtensor/models/transformer.h"
#include "dtensor/pp/pipeline.h"
#include "lr_schedule.h"
#include "options.h"
#include "plan_file.h"

namespace dtensor::train {

// --layout-invariant: the segments each global batch is cut into whatever the layout, so also the
// largest --dp-shard the mode covers (the library's; models/parallel_dims.h).
inline constexpr int64_t kLayoutInvariantBatchSegments = models::kLayoutInvariantBatchSegments;

struct RunConfig {
  std::string preset;        // training defaults come from it
  std::string model_source;  // "preset demo", the --config path or the --hf checkpoint
  models::DecoderConfig model;
  // --hf: the checkpoint directory whose weights the model starts from, its architecture and
  // the dtype of its stored weights (the fine-tuned model is written back in both).
  std::string hf_dir;
  std::string hf_architecture;
  c10::ScalarType hf_dtype = c10::kFloat;
  int64_t steps = 0;       // the length of the schedule
  int64_t stop_at = 0;     // the last step of this run (<= steps)
  int64_t batch_size = 0;  // global: split over the dp ranks
  int64_t seq_len = 0;
  LrSchedule schedule;
  double weight_decay = 0;
  double beta1 = 0.9, beta2 = 0.95;
  double grad_clip = 0;  // 0: no clipping
  uint64_t seed = 0;
  int64_t eval_every = 0;  // 0: only at the end
  int64_t eval_batches = 0;
  c10::ScalarType dtype = c10::kFloat;
  int64_t world_size = 1, dp = 1, tp = 1;
  int64_t ep = 1;                                 // --ep: expert parallelism over the tp ranks
  models::ExpertParallelOptions expert_parallel;  // --moe-dispatch, --capacity-factor
  // --dp-shard: the dp ranks shard the parameters (fully_shard); --dp: they replicate them
  bool fsdp = false;
  bool sequence_parallel = true;
  bool loss_parallel = true;
  bool overlap_comm = false;          // --overlap-comm
  std::string ac = "none";            // activation checkpointing mode (dtensor/ac/checkpoint.h)
  bool ac_replay_collectives = true;  // false: --ac-recompute-collectives
  bool bf16 = false;             // --mixed-precision bf16: FSDP gathers and computes in bfloat16
  std::optional<PlanFile> plan;  // --plan: used instead of the built-in Llama plan
  double verify_rtol = 1e-4;
  // --layout-invariant P: every sum over a sharded dim in P canonical segments, so TP 1, 2, 4
  // (dividing P) train bit for bit alike (ops::LayoutInvariantMode); 0: off.
  int64_t layout_invariant = 0;
  // dtensor_plan: the model is built on the meta device (shapes and dtypes, no values) and the
  // pipeline stages are told their boundary activations instead of exchanging their shapes.
  bool meta = false;

  // --cp: ranks splitting each sequence (world_size = cp x tp), how keys and values move
  // (cp::RotateMethod's name); --pack-documents: rows of whole documents, attended within each.
  int64_t cp = 1;
  std::string cp_rotate = "ring";
  bool pack_documents = false;

  // --pp: pipeline stages (world_size = pp x dp x tp), their schedule and micro-batches.
  int64_t pp = 1;
  std::string pp_schedule = "1f1b";  // gpipe | 1f1b | interleaved
  int64_t microbatches = 1;
  int64_t virtual_stages = 1;  // stages per rank (interleaved: --virtual-stages)

  int64_t tokens_per_step() const { return batch_size * seq_len; }
  // The degrees (world_size = pp x dp x tp; dp shards with fsdp, else replicates).
  models::ParallelDims parallel_dims() const;
  // The idle share of a step the schedule predicts: (pp - 1) / (v M + pp - 1).
  double bubble_formula() const { return pp::bubble_fraction(pp, virtual_stages, microbatches); }
  // The settings as one JSON object ({"model": ..., "train": ...}) for DIR/config.json.
  std::string to_json() const;
};

// The same run on one device with plain LibTorch (--verify-tp1, --pp checkpoints).
RunConfig one_device(const RunConfig& config);

// The library's parallelize options for the run (models/parallelize.h): the TP plan (built-in
// or --plan), AC, and FSDP over "dp" with --dp-shard (with bf16: compute in bfloat16, reduce
// in float32), for the whole model and for each pipeline stage alike.
models::ParallelizeOptions parallelize_options(const RunConfig& config);

// What the library checks a layout against besides its degrees and the model
// (ParallelDims::validate): the parallelize options, the pipeline, the batch and the dtype.
models::TrainingOptions training_options(const RunConfig& config);

// The logits the loss is computed from: float32 with bf16 mixed precision (as torchtitan
// computes it), else as they are.
at::Tensor logits_for_loss(const RunConfig& config, const at::Tensor& logits);

// Throws std::invalid_argument with a message that names the option to change.
RunConfig resolve_run_config(const TrainOptions& options, int64_t world_size);

}  // namespace dtensor::train
