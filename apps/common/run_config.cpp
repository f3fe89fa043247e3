#include "run_config.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "corpus.h"
#include "dtensor/ac/checkpoint.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/util/error_message.h"
#include "tokenizer.h"

namespace dtensor::train {
namespace {

// Training defaults that suit each model size on a few CPU cores.
struct PresetDefaults {
  int64_t steps;
  int64_t batch_size;
  double lr;
};

PresetDefaults defaults_for(const std::string& preset) {
  if (preset == "tiny" || preset == "tiny-moe") return {20, 4, 3e-3};
  // --hf: a pretrained model moves a little, as fine-tuning recipes do (2e-5 is common).
  if (preset == "hf") return {60, 8, 2e-5};
  if (preset == "bench") return {50, 8, 1e-3};
  // demo: 60 steps of 8 x 256 tokens take about 30 s at TP=2 on 2 cores and the --verify-tp1
  // re-run about 20 s more; the loss falls from about 5.9 to under 2. Longer float32 runs
  // drift apart from the one-device run beyond the 1e-4 check (about 1e-3 after 150 steps).
  return {60, 8, 3e-3};
}

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// --pp N: the stages' schedule and micro-batches (ParallelDims::validate checks what combines).
void resolve_pipeline(const TrainOptions& o, RunConfig& c) {
  c.pp = o.pp;
  c.pp_schedule = o.schedule.value_or("1f1b");
  if (o.virtual_stages && c.pp_schedule != "interleaved")
    bad("--virtual-stages applies to --schedule interleaved");
  c.virtual_stages = c.pp_schedule == "interleaved" ? o.virtual_stages.value_or(2) : 1;
  c.microbatches = o.microbatches.value_or(o.pp);
  // Activations cross stage boundaries as replicated plain tensors.
  c.sequence_parallel = false;
}

// --hf DIR: the model is the checkpoint's (options.cpp refuses the flags that would change it).
void resolve_hf_model(const TrainOptions& o, RunConfig& c) {
  if (!o.config_path.empty() || o.model_config || o.dim || o.layers || o.heads || o.kv_heads ||
      o.ffn_dim || o.vocab)
    bad("--hf " + o.hf_dir + " gives the model (its config.json): drop --config and the " +
        "model-shape flags");
  if (!std::filesystem::is_directory(o.hf_dir)) bad("--hf: no such directory '" + o.hf_dir + "'");
  models::HfConfig hf;
  try {
    hf = models::read_hf_config(o.hf_dir);
  } catch (const std::exception& e) {
    bad("--hf: " + util::error_message(e));
  }
  c.preset = "hf";
  c.hf_dir = o.hf_dir;
  c.hf_architecture = hf.architecture;
  c.hf_dtype = hf.dtype;
  c.model_source = hf.architecture + " " + o.hf_dir;
  // The rotary table keeps max_position_embeddings, so that the written config.json does too;
  // the training windows are --seq-len long.
  c.model = hf.config;
  c.model.validate();
  c.seq_len = o.seq_len.value_or(std::min<int64_t>(c.model.max_seq_len, 256));
  if (c.seq_len > c.model.max_seq_len) {
    bad("--seq-len " + std::to_string(c.seq_len) + " is longer than max_position_embeddings " +
        std::to_string(c.model.max_seq_len) + " of " + o.hf_dir + "/config.json");
  }
}

// The model: a preset or a config file, then the flags that override its fields.
void resolve_model(const TrainOptions& o, RunConfig& c) {
  if (!o.hf_dir.empty()) return resolve_hf_model(o, c);
  c.preset = o.preset;
  if (o.model_config) {
    c.model_source = "the config given";
    c.model = *o.model_config;
  } else if (!o.config_path.empty()) {
    c.model_source = o.config_path;
    c.model = models::DecoderConfig::from_json(read_text_file(o.config_path));
  } else {
    c.model_source = "preset " + o.preset;
    c.model = models::DecoderConfig::preset(o.preset);
  }
  if (o.dim) c.model.dim = *o.dim;
  if (o.layers) c.model.n_layers = *o.layers;
  if (o.heads) c.model.n_heads = *o.heads;
  if (o.kv_heads) c.model.n_kv_heads = *o.kv_heads;
  if (o.ffn_dim) c.model.ffn_hidden_dim = *o.ffn_dim;
  if (o.vocab) c.model.vocab_size = *o.vocab;
  if (o.seq_len) c.model.max_seq_len = *o.seq_len;
  if (c.model.vocab_size < ByteTokenizer::kVocabSize) {
    bad("vocab_size " + std::to_string(c.model.vocab_size) +
        " is too small for the byte-level tokenizer: it needs at least 256 (--vocab)");
  }
  c.model.validate();
  c.seq_len = c.model.max_seq_len;
}

// Steps, batch, learning-rate schedule, optimizer, evaluation and precision.
void resolve_training(const TrainOptions& o, RunConfig& c) {
  const auto d = defaults_for(c.preset);
  if (o.dropout >= 1) bad("--dropout " + num(o.dropout) + ": a probability below 1 (e.g. 0.1)");
  c.model.dropout = o.dropout;
  c.steps = o.steps.value_or(d.steps);
  c.stop_at = std::min(c.steps, o.stop_at.value_or(c.steps));
  c.batch_size = o.batch_size.value_or(d.batch_size);
  c.schedule.lr = o.lr.value_or(d.lr);
  c.schedule.min_lr = o.min_lr.value_or(c.schedule.lr / 10);
  c.schedule.warmup = o.warmup.value_or(c.steps / 10);
  c.schedule.total_steps = c.steps;
  if (c.schedule.min_lr > c.schedule.lr) {
    bad("--min-lr " + num(c.schedule.min_lr) + " is larger than the learning rate " +
        num(c.schedule.lr));
  }
  if (c.schedule.warmup > c.steps) {
    bad("--warmup " + std::to_string(c.schedule.warmup) + " is longer than the run (" +
        std::to_string(c.steps) + " steps)");
  }
  c.weight_decay = o.weight_decay;
  c.beta1 = o.beta1;
  c.beta2 = o.beta2;
  c.grad_clip = o.grad_clip;
  c.seed = static_cast<uint64_t>(o.seed);
  c.eval_every = o.eval_every.value_or(std::max<int64_t>(1, c.steps / 5));
  c.eval_batches = o.eval_batches;
  c.dtype = o.dtype == "float64" ? c10::kDouble : c10::kFloat;
  c.verify_rtol = o.verify_rtol.value_or(c.dtype == c10::kDouble ? 1e-9 : 1e-4);
}

// --layout-invariant P: the sums of every layout the mode covers (ParallelDims::validate) in P
// canonical segments. The norms run on whole sequences at every layout: pipeline stages cannot
// shard them.
void resolve_layout_invariant(const TrainOptions& o, RunConfig& c) {
  if (o.layout_invariant == 0) return;
  if (!c.plan) c.sequence_parallel = false;
  c.layout_invariant = o.layout_invariant;
}

// The degrees, the TP plan's options and the pipeline; then every rule of combining them with
// the model and the batch, in the library's words (models::ParallelDims::validate).
void resolve_parallelism(const TrainOptions& o, int64_t world_size, RunConfig& c) {
  c.sequence_parallel = o.sequence_parallel;
  c.loss_parallel = o.loss_parallel;
  c.overlap_comm = o.overlap_comm;
  c.ac = o.ac;
  if (o.ac_recompute_collectives && o.ac == "none")
    bad("--ac-recompute-collectives changes what --ac full or selective does: add one of them");
  c.ac_replay_collectives = !o.ac_recompute_collectives;
  if (o.pp == 1 && (o.schedule || o.microbatches))
    bad("--schedule and --microbatches apply to pipeline parallelism: add --pp N (N > 1)");
  if (o.pp > 1) resolve_pipeline(o, c);
  if (o.cp_rotate && o.cp == 1)
    bad("--cp-rotate says how context parallelism moves keys and values: add --cp N (N > 1)");
  if (o.pack_documents && o.cp == 1)
    bad("--pack-documents attends within each document through context parallelism's "
        "attention: add --cp N (N > 1)");
  if (o.pack_documents && o.verify_tp1)
    bad("--verify-tp1 runs plain attention on one device, which crosses document boundaries: "
        "drop it with --pack-documents");
  if (o.cp > 1 && o.dp_shard > 1)
    bad("--cp with --dp-shard is not built into dtensor_train yet (models::parallelize folds cp "
        "into FSDP): use --cp with TP alone");
  c.cp = o.cp;
  c.cp_rotate = o.cp_rotate.value_or("ring") == "allgather" ? "all_gather" : "ring";
  c.pack_documents = o.pack_documents;
  if (!o.plan_path.empty()) {
    c.plan = read_plan_file(o.plan_path);
    c.sequence_parallel = c.plan->sequence_parallel;
  }
  if (o.mixed_precision == "bf16") {
    c.bf16 = true;
    // bfloat16 keeps 8 significant bits: losses move by up to ~1e-3 relative from float32's
    // (4.6e-4 measured on the tiny preset over 6 steps), so the one-device check allows 1%.
    if (!o.verify_rtol) c.verify_rtol = 1e-2;
  }
  models::ParallelDims dims;
  try {
    // TP takes the ranks the other degrees leave.
    dims = models::ParallelDims{.dp_replicate = o.dp,
                                .dp_shard = o.dp_shard,
                                .cp = o.cp,
                                .tp = -1,
                                .pp = o.pp,
                                .ep = o.ep,
                                .world_size = world_size,
                                .world_mesh = std::nullopt}
               .resolved();
  } catch (const std::exception& e) {
    bad(util::error_message(e));
  }
  c.world_size = world_size;
  c.fsdp = dims.dp_shard > 1;
  c.dp = dims.dp();
  c.tp = dims.tp;
  c.ep = dims.ep;
  try {
    c.expert_parallel = {.dispatch = models::parse_moe_dispatch(o.moe_dispatch),
                         .capacity_factor = o.capacity_factor};
  } catch (const std::exception& e) {
    bad(util::error_message(e));
  }
  // --layout-invariant: the micro-batches are the batch segments of a dp rank.
  if (c.pp > 1 && o.layout_invariant > 0 && !o.microbatches)
    c.microbatches = std::max<int64_t>(1, models::kLayoutInvariantBatchSegments / c.dp);
  resolve_layout_invariant(o, c);
  try {
    dims.validate(c.model, training_options(c));
  } catch (const std::exception& e) {
    bad(util::error_message(e));
  }
}

}  // namespace

RunConfig resolve_run_config(const TrainOptions& o, int64_t world_size) {
  RunConfig c;
  resolve_model(o, c);
  resolve_training(o, c);
  resolve_parallelism(o, world_size, c);
  return c;
}

RunConfig one_device(const RunConfig& config) {
  RunConfig one = config;
  one.world_size = one.dp = one.cp = one.tp = one.ep = one.pp = one.virtual_stages = 1;
  one.fsdp = false;
  one.bf16 = false;          // FSDP's mixed precision: one device runs (and checks against) float32
  one.layout_invariant = 0;  // plain LibTorch: no DTensor sums to make canonical
  return one;
}

std::string RunConfig::to_json() const {
  std::ostringstream js;
  js << "{\n  \"model\": " << model.to_json() << ",\n  \"train\": {"
     << "\"preset\": \"" << preset << "\", \"steps\": " << steps
     << ", \"batch_size\": " << batch_size << ", \"seq_len\": " << seq_len
     << ", \"lr\": " << num(schedule.lr) << ", \"min_lr\": " << num(schedule.min_lr)
     << ", \"warmup\": " << schedule.warmup << ", \"weight_decay\": " << num(weight_decay)
     << ", \"beta1\": " << num(beta1) << ", \"beta2\": " << num(beta2)
     << ", \"grad_clip\": " << num(grad_clip) << ", \"seed\": " << seed
     << ", \"eval_every\": " << eval_every << ", \"eval_batches\": " << eval_batches
     << ", \"dtype\": \"" << (dtype == c10::kDouble ? "float64" : "float32") << "\""
     << ", \"world_size\": " << world_size << ", \"dp\": " << dp << ", \"tp\": " << tp
     << ", \"ep\": " << ep << ", \"fsdp\": " << (fsdp ? "true" : "false")
     << (bf16 ? ", \"mixed_precision\": \"bf16\"" : "") << ", \"pp\": " << pp
     << ", \"pp_schedule\": \"" << pp_schedule << "\", \"microbatches\": " << microbatches
     << ", \"virtual_stages\": " << virtual_stages
     << ", \"sequence_parallel\": " << (sequence_parallel ? "true" : "false")
     << ", \"loss_parallel\": " << (loss_parallel ? "true" : "false") << ", \"ac\": \"" << ac
     << "\"" << (ac_replay_collectives ? "" : ", \"ac_recompute_collectives\": true");
  if (cp > 1) js << ", \"cp\": " << cp << ", \"cp_rotate\": \"" << cp_rotate << "\"";
  if (pack_documents) js << ", \"pack_documents\": true";
  if (layout_invariant > 0) js << ", \"layout_invariant\": " << layout_invariant;
  if (plan) js << ", \"plan\": " << std::quoted(plan->path);
  if (!hf_dir.empty()) js << ", \"hf\": " << std::quoted(hf_dir);
  js << "}\n}\n";
  return js.str();
}

models::ParallelDims RunConfig::parallel_dims() const {
  models::ParallelDims d{
      .cp = cp, .tp = tp, .pp = pp, .ep = ep, .world_size = world_size, .world_mesh = std::nullopt};
  (fsdp ? d.dp_shard : d.dp_replicate) = dp;
  return d;
}

models::TrainingOptions training_options(const RunConfig& config) {
  models::TrainingOptions t;
  t.parallelize = parallelize_options(config);
  t.pipeline = {.schedule = config.pp_schedule,
                .virtual_stages = config.virtual_stages,
                .microbatches = config.microbatches};
  t.batch_size = config.batch_size;
  t.seq_len = config.seq_len;
  t.dtype = config.dtype;
  t.layout_invariant = config.layout_invariant;
  return t;
}

models::ParallelizeOptions parallelize_options(const RunConfig& config) {
  models::ParallelizeOptions o;
  o.tp.sequence_parallel = config.sequence_parallel;
  o.tp.loss_parallel = config.loss_parallel;
  o.tp.overlap_comm = config.overlap_comm;
  o.tp.ep = config.ep;
  o.tp.expert_parallel = config.expert_parallel;
  if (config.plan) {
    o.tp_plan = [plan = *config.plan](models::TransformerImpl& model, const DeviceMesh& tp_mesh) {
      apply_plan_file(model, tp_mesh, plan);
    };
  }
  o.ac = ac::parse_ac_mode(config.ac);
  o.ac_options.replay_collectives = config.ac_replay_collectives;
  o.fully_shard = config.fsdp;
  // The mode's one-device run takes TP's canonical sums too: TP on a one-rank mesh.
  o.tensor_parallel_on_one_rank = config.layout_invariant > 0;
  if (config.bf16) {  // compute in bfloat16, reduce in float32 (torchtitan's default)
    o.fsdp.param_dtype = at::kBFloat16;
    o.fsdp.reduce_dtype = at::kFloat;
  }
  return o;
}

at::Tensor logits_for_loss(const RunConfig& config, const at::Tensor& logits) {
  return config.bf16 ? logits.to(at::kFloat) : logits;
}

}  // namespace dtensor::train
