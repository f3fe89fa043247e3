#pragma once
// Command-line options of dtensor_train.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/models/transformer.h"

namespace dtensor::train {

struct TrainOptions {
  // Model: a preset, optionally a JSON config replacing it, then single-field overrides; or a
  // Hugging Face checkpoint directory to fine-tune (--hf), which gives the model alone.
  std::string preset = "demo";
  std::string hf_dir;
  std::string hf_out;  // where the fine-tuned HF directory goes; empty: OUT/hf
  std::string config_path;
  // The model as a config object, in place of the preset and the --config file (dtensor_plan
  // --hf-config reads one from a Hugging Face config.json); the shape flags still override it.
  std::optional<models::DecoderConfig> model_config;
  std::optional<int64_t> dim, layers, heads, kv_heads, vocab, seq_len, ffn_dim;

  // Optimization.
  std::optional<int64_t> steps;       // default depends on the preset
  std::optional<int64_t> stop_at;     // end this run after that step (the schedule keeps steps)
  std::optional<int64_t> batch_size;  // default depends on the preset
  std::optional<double> lr;           // default depends on the preset
  std::optional<double> min_lr;       // default lr / 10
  std::optional<int64_t> warmup;      // default steps / 10
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;  // 0 disables clipping
  int64_t seed = 1234;
  double dropout = 0;  // residual dropout probability

  // Data.
  std::string data_path;  // empty: the built-in corpus
  double val_fraction = 0.1;
  // Rows of whole documents (the text's paragraphs) packed up to --seq-len, attention within
  // each document (--pack-documents).
  bool pack_documents = false;

  // Evaluation and output.
  std::optional<int64_t> eval_every;  // default steps / 5; 0 = only at the end
  int64_t eval_batches = 4;
  std::string out_dir = "runs/latest";
  int64_t ckpt_every = 0;  // 0: no periodic checkpoints
  int64_t keep_ckpts = 2;
  bool final_ckpt = false;
  std::optional<std::string> resume;  // "auto" or a checkpoint path
  int64_t log_every = 0;              // plain progress lines; 0 = about 20 per run
  std::string progress = "auto";      // auto (bar on a terminal) | bar | lines

  // Parallelism and numerics.
  bool sequence_parallel = true;
  bool loss_parallel = true;
  // Overlap the sequence-parallel collectives with the matmuls (--overlap-comm).
  bool overlap_comm = false;
  std::string plan_path;    // a TP plan as JSON instead of the built-in Llama plan (plan_file.h)
  bool print_plan = false;  // print the TP plan the run would apply (as a --plan file), exit
  int64_t dp = 1;
  int64_t dp_shard = 1;                   // FSDP degree (fully_shard over that many ranks); 1: off
  int64_t ep = 1;                         // expert parallelism, folded over the TP ranks; 1: off
  std::string moe_dispatch = "dropless";  // --moe-dispatch: dropless | capacity
  double capacity_factor = 1.0;           // --capacity-factor (capacity dispatch)
  std::string ac = "none";                // activation checkpointing: none | full | selective
  bool ac_recompute_collectives = false;  // the recompute communicates instead of replaying
  std::string mixed_precision = "none";   // none | bf16 (with --dp-shard)
  std::string dtype = "float32";
  int64_t threads = 1;
  // --layout-invariant P: the same bits at every TP degree dividing P (ops::LayoutInvariantMode
  // with P segments); 0: off.
  int64_t layout_invariant = 0;

  // Context parallelism: --cp ranks split each sequence, keys and values passed round a ring
  // or all-gathered (--cp-rotate); 1: off.
  int64_t cp = 1;
  std::optional<std::string> cp_rotate;

  // Pipeline parallelism: --pp stages, ranks form a pp x tp mesh; 1: off.
  int64_t pp = 1;
  std::optional<std::string> schedule;    // gpipe | 1f1b (default 1f1b)
  std::optional<int64_t> microbatches;    // per step (default: pp)
  std::optional<int64_t> virtual_stages;  // stages per rank of --schedule interleaved (default 2)

  // After training, re-run the same steps on one device and compare the losses.
  bool verify_tp1 = false;
  std::optional<double> verify_rtol;  // default 1e-4 (float32), 1e-9 (float64)

  int64_t sample_chars = 0;  // characters of text generated after training (0: none)
};

// Parses argv. Returns the options, or nullopt with `exit_code` set after the help text (0,
// on stdout) or a usage error (2, on stderr) has been printed; `quiet` prints nothing (the
// ranks other than 0 would repeat rank 0's message).
std::optional<TrainOptions> parse_args(int argc, char** argv, int& exit_code, bool quiet = false);

extern const char* const kUsage;

}  // namespace dtensor::train
