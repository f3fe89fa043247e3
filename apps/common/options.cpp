#include "options.h"

#include "cli.h"

namespace dtensor::train {

namespace cli = dtensor::cli;

const char* const kUsage = R"help(usage: dtensor_train [options]

Trains a decoder-only transformer, a bundled preset (Llama-shaped; --preset, --config) or a
Hugging Face checkpoint (--hf), on the ranks of the launch: tensor parallelism over the ranks
that --dp/--dp-shard and --pp leave (TP degree = number of ranks / (dp x pp); all of them by
default), on the built-in text or a file, with AdamW and a warmup + cosine learning-rate
schedule. Rank 0 shows progress on stderr and writes metrics.csv, loss.svg and checkpoints to
--out.

  build/apps/dtrun/dtrun -n 2 build/apps/train/dtensor_train --preset demo --verify-tp1

Also runs under torchrun --no-python, srun or mpirun (ranks meet through their environment
variables) and alone as one rank.

Fine-tuning a Hugging Face checkpoint (Llama, Qwen2, Qwen3 or Mistral; a save_pretrained
directory with config.json, safetensors and tokenizer.json):

  build/apps/dtrun/dtrun -n 2 build/apps/train/dtensor_train --hf Qwen3-0.6B --data my.txt \
      --steps 100 --seq-len 512 --out runs/ft      # writes runs/ft/hf, which transformers loads

model:
  --hf DIR               fine-tune the Hugging Face checkpoint in DIR: the model from
                         DIR/config.json and its weights, the text tokenized with
                         DIR/tokenizer.json (with its template, e.g. Llama 3's BOS); at the end
                         the trained model goes to --hf-out as an HF directory (config.json,
                         model.safetensors in the checkpoint's dtype, tokenizer files copied).
                         Not with --preset, --config or the model-shape flags below; --seq-len
                         is the training length (default: max_position_embeddings, at most
                         256); default --lr 2e-5, --steps 60, --batch-size 8
  --hf-out DIR           where --hf writes the fine-tuned model (default OUT/hf)
  --preset NAME          tiny | tiny-moe | demo | bench (default demo); tiny-moe: tiny with
                         4 experts of width 16, top 2, in both layers
  --config FILE          model config as JSON (DecoderConfig fields), replaces the preset
  --dim N                hidden size
  --layers N             transformer blocks
  --heads N              attention heads
  --kv-heads N           key/value heads (grouped-query attention)
  --ffn-dim N            feed-forward hidden size
  --vocab N              vocabulary size (>= 256: the tokenizer is byte-level)
  --seq-len N            training sequence length, also the model's maximum (default:
                         tiny 64, demo 256, bench 512)

optimization:
  --steps N              optimizer steps (default: tiny 20, demo 60, bench 50)
  --stop-at N            end this run after step N, as if interrupted; the schedule still
                         spans --steps and --resume continues the run
  --batch-size N         sequences per step (default: tiny 4, demo 8, bench 8)
  --lr X                 peak learning rate (default: 3e-3; bench 1e-3)
  --min-lr X             final learning rate of the cosine decay (default lr/10)
  --warmup N             linear warmup steps (default steps/10)
  --weight-decay X       AdamW weight decay on matrices (default 0.1)
  --beta1 X, --beta2 X   AdamW betas (default 0.9, 0.95)
  --grad-clip X          clip the global gradient norm to X; 0 disables (default 1.0)
  --dropout P            residual dropout: each block's attention and feed-forward outputs
                         dropped out with probability P in training, the mask keyed by the
                         step and the element's place in the global batch, so the same at
                         every layout (default 0; needs --no-sequence-parallel under TP)
  --seed N               seed of the weights and the batches (default 1234)

data:
  --data FILE            train on this text file (default: the built-in corpus)
  --val-fraction X       held-out tail of the text for validation (default 0.1)
  --pack-documents       each row packs whole documents (the text's paragraphs, split at
                         blank lines) from a document's start up to --seq-len, and attention
                         stays within each document (positions restart at each; a document's
                         last token predicts nothing); needs --cp N

evaluation and output:
  --eval-every N         validation loss every N steps and at the end; 0: only at the end
                         (default steps/5)
  --eval-batches N       batches per validation (default 4)
  --out DIR              metrics.csv, loss.svg, config.json, checkpoints/ (default runs/latest)
  --ckpt-every N         save a checkpoint every N steps (default 0: never)
  --keep-ckpts N         checkpoints kept on disk (default 2)
  --save-final           also save a checkpoint after the last step
  --resume [PATH|auto]   continue from a checkpoint; auto (or no value): the latest in
                         DIR/checkpoints
  --progress MODE        auto | bar | lines: a bar redrawn in place, or plain lines (auto:
                         the bar when stderr is a terminal; under dtrun it is a pipe, so
                         pass bar when dtrun's output is a terminal)
  --log-every N          steps between plain progress lines (default: about 20 per run)
  --sample N             after training, print N characters (tokens with --hf) generated
                         from the model

parallelism and numerics:
  --no-sequence-parallel keep activations replicated between blocks
  --no-loss-parallel     gather the logits instead of a vocab-parallel cross entropy
  --overlap-comm         overlap each block's sequence-parallel all-gathers and
                         reduce-scatters with its matmuls (same results, bitwise)
  --plan FILE            the TP plan from a JSON file instead of the built-in one (then the
                         two options above do not apply): whether it shards the sequence,
                         and module paths (wildcards allowed) to styles as PyTorch writes
                         them, applied in file order, e.g.
                           {"sequence_parallel": false,
                            "plan": {"layers.*.attention.wq": "ColwiseParallel()",
                                     "output": "ColwiseParallel(output_layouts=Replicate())"}}
  --print-plan           print the TP plan this launch would apply, as a --plan file (the
                         built-in one for its TP degree and the options above), and exit
  --dp N                 data-parallel degree (plain replication: each rank trains on its rows
                         of the batch, the gradients averaged after backward); ranks form a
                         dp x tp mesh, pp x dp x tp with --pp (default 1)
  --dp-shard N           fully sharded data parallelism (FSDP) over N ranks: each rank holds
                         1/N of the parameters, gradients and AdamW state (of its TP share)
                         and gathers a block's parameters while it runs; ranks form a
                         dp_shard x tp mesh (not with --dp or --plan); checkpoints hold
                         the global tensors and resume at any --dp-shard/--dp/TP layout
  --cp N                 context parallelism: each sequence split over N ranks (balanced by
                         attention work: head-tail for whole rows, per document with
                         --pack-documents); ranks form a cp x tp mesh (not with --dp,
                         --dp-shard or --pp)
  --cp-rotate M          how --cp moves keys and values: ring (default; cp - 1 exchanges per
                         layer) | allgather (2 all-gathers per layer)
  --ep N                 expert parallelism (mixture-of-experts models), folded over the TP
                         ranks (N = the TP degree): each rank holds num_experts / N whole
                         experts and the sparse layers send each token to the ranks holding
                         its experts by all-to-all; num_experts must divide by N
  --moe-dispatch M       with --ep: dropless (default: per-expert counts exchanged, then an
                         uneven all-to-all) | capacity (fixed buffers per expert, no read back
                         to the host; choices beyond the capacity are dropped)
  --capacity-factor F    capacity dispatch: each expert takes ceil(F x tokens x top_k /
                         num_experts) rows from each rank (default 1)
  --pp N                 pipeline parallelism: the blocks split over N stages (the first
                         also holds the embedding, the last the norm and output head), TP
                         without sequence parallelism inside each; ranks form a pp x tp
                         mesh, pp x dp_shard x tp with --dp-shard (FSDP inside each stage,
                         one reduce-scatter per step) or pp x dp x tp with --dp (one
                         all-reduce per stage and step); not with --plan
  --schedule S           pipeline schedule: gpipe | 1f1b | interleaved (default 1f1b)
  --virtual-stages V     interleaved: each rank runs V stages of V x N (round-robin; default 2)
  --microbatches M       micro-batches per step; must divide --batch-size (default: N of
                         --pp). The progress line shows the measured bubble (the mean over
                         stages of the share of a step spent waiting) and (pp-1)/(VM+pp-1)
  --ac MODE              activation checkpointing: none (default) | full (every block
                         recomputes its forward in backward) | selective (every other block)
  --ac-recompute-collectives
                         the recompute issues the blocks' TP collectives again instead of
                         replaying their kept results: less memory (under TP without
                         sequence parallelism a block keeps 1/3 as much), more communication
  --mixed-precision M    none (default) | bf16: with --dp-shard, parameters and AdamW state
                         stay float32 while the all-gathers and the compute run in bfloat16;
                         gradients are reduce-scattered in float32 (needs --dtype float32)
  --dtype T              float32 | float64 (default float32)
  --threads N            intra-op threads per rank (default 1)
  --layout-invariant P   the same bits at every layout: TP degrees dividing P (a power of
                         two, e.g. 4), --dp-shard 1 or 2, --pp with one stage per rank. Each
                         sum over a split dimension is cut into P fixed segments added in one
                         fixed order, and each batch into 2 segments (the micro-batches under
                         --pp), so runs at TP 1, 2 and 4, FSDP 1 and 2 and PP 1 and 2 give
                         identical losses and weights (about 1.1x the step time); blocks run
                         without sequence parallelism; not with --dp, --overlap-comm,
                         --mixed-precision bf16 or --schedule interleaved
  --verify-tp1           afterwards re-run the same steps on one device with plain LibTorch
                         and compare the losses; exit 3 on a mismatch
  --verify-rtol X        relative tolerance of that check (default 1e-4; 1e-9 in float64)

  -h, --help             print this help
)help";

namespace {
// Options that stay unset (nullopt) unless given: their defaults depend on other settings.
template <typename T>
CLI::Option* add_optional(CLI::App& app, const std::string& name, std::optional<T>& field) {
  return app.add_option_function<T>(name, [&field](const T& v) { field = v; });
}

void add_model_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--hf", o.hf_dir)->check(cli::non_empty());
  app.add_option("--hf-out", o.hf_out)->check(cli::non_empty());
  app.add_option("--preset", o.preset)->check(cli::one_of({"tiny", "tiny-moe", "demo", "bench"}));
  app.add_option("--config", o.config_path)->check(cli::non_empty());
  add_optional(app, "--dim", o.dim)->check(cli::integer(1));
  add_optional(app, "--layers", o.layers)->check(cli::integer(1));
  add_optional(app, "--heads", o.heads)->check(cli::integer(1));
  add_optional(app, "--kv-heads", o.kv_heads)->check(cli::integer(1));
  add_optional(app, "--ffn-dim", o.ffn_dim)->check(cli::integer(1));
  add_optional(app, "--vocab", o.vocab)->check(cli::integer(256));
  add_optional(app, "--seq-len", o.seq_len)->check(cli::integer(1));
}

void add_optimization_options(CLI::App& app, TrainOptions& o) {
  add_optional(app, "--steps", o.steps)->check(cli::integer(1));
  add_optional(app, "--stop-at", o.stop_at)->check(cli::integer(1));
  add_optional(app, "--batch-size", o.batch_size)->check(cli::integer(1));
  add_optional(app, "--lr", o.lr)->check(cli::number(0, 10, /*min_open=*/true));
  add_optional(app, "--min-lr", o.min_lr)->check(cli::number(0, 10));
  add_optional(app, "--warmup", o.warmup)->check(cli::integer(0));
  app.add_option("--weight-decay", o.weight_decay)->check(cli::number(0));
  app.add_option("--beta1", o.beta1)->check(cli::number(0, 1));
  app.add_option("--beta2", o.beta2)->check(cli::number(0, 1));
  app.add_option("--grad-clip", o.grad_clip)->check(cli::number(0));
  app.add_option("--seed", o.seed)->check(cli::integer(0));
  app.add_option("--dropout", o.dropout)->check(cli::number(0, 1));
}

void add_data_and_output_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--data", o.data_path)->check(cli::non_empty());
  app.add_option("--val-fraction", o.val_fraction)->check(cli::number(0, 0.5, true));
  app.add_flag("--pack-documents", o.pack_documents);
  add_optional(app, "--eval-every", o.eval_every)->check(cli::integer(0));
  app.add_option("--eval-batches", o.eval_batches)->check(cli::integer(1));
  app.add_option("--out", o.out_dir)->check(cli::non_empty());
  app.add_option("--ckpt-every", o.ckpt_every)->check(cli::integer(0));
  app.add_option("--keep-ckpts", o.keep_ckpts)->check(cli::integer(1));
  app.add_flag_callback("--save-final", [&o] { o.final_ckpt = true; })->disable_flag_override();
  // The value is optional: "--resume" alone (or before another option) means auto.
  app.add_option_function<std::string>("--resume", [&o](const std::string& v) { o.resume = v; })
      ->expected(0, 1)
      ->default_str("auto");
  app.add_option("--log-every", o.log_every)->check(cli::integer(1));
  app.add_option("--progress", o.progress)->check(cli::one_of({"auto", "bar", "lines"}));
  app.add_option("--sample", o.sample_chars)->check(cli::integer(0));
}

void add_parallel_options(CLI::App& app, TrainOptions& o) {
  app.add_flag_callback("--no-sequence-parallel", [&o] { o.sequence_parallel = false; })
      ->disable_flag_override();
  app.add_flag_callback("--no-loss-parallel", [&o] { o.loss_parallel = false; })
      ->disable_flag_override();
  app.add_flag_callback("--overlap-comm", [&o] { o.overlap_comm = true; })->disable_flag_override();
  app.add_option("--plan", o.plan_path)->check(cli::non_empty());
  app.add_flag("--print-plan", o.print_plan);
  app.add_option("--dp", o.dp)->check(cli::integer(1));
  app.add_option("--dp-shard", o.dp_shard)->check(cli::integer(1));
  app.add_option("--ep", o.ep)->check(cli::integer(1));
  app.add_option("--moe-dispatch", o.moe_dispatch)->check(cli::one_of({"dropless", "capacity"}));
  app.add_option("--capacity-factor", o.capacity_factor)->check(cli::number(0, 1e6, true));
  app.add_option("--pp", o.pp)->check(cli::integer(1));
  app.add_option("--cp", o.cp)->check(cli::integer(1));
  add_optional(app, "--cp-rotate", o.cp_rotate)->check(cli::one_of({"ring", "allgather"}));
  add_optional(app, "--schedule", o.schedule)->check(cli::one_of({"gpipe", "1f1b", "interleaved"}));
  add_optional(app, "--virtual-stages", o.virtual_stages)->check(cli::integer(1));
  add_optional(app, "--microbatches", o.microbatches)->check(cli::integer(1));
  app.add_option("--ac", o.ac)->check(cli::one_of({"none", "full", "selective"}));
  app.add_flag("--ac-recompute-collectives", o.ac_recompute_collectives);
  app.add_option("--mixed-precision", o.mixed_precision)->check(cli::one_of({"none", "bf16"}));
  app.add_option("--dtype", o.dtype)->check(cli::one_of({"float32", "float64"}));
  app.add_option("--threads", o.threads)->check(cli::integer(1));
  app.add_option("--layout-invariant", o.layout_invariant)->check(cli::integer(1));
  app.add_flag_callback("--verify-tp1", [&o] { o.verify_tp1 = true; })->disable_flag_override();
  add_optional(app, "--verify-rtol", o.verify_rtol)->check(cli::number(0, 1, true));
}

}  // namespace

std::optional<TrainOptions> parse_args(int argc, char** argv, int& exit_code, bool quiet) {
  TrainOptions o;
  CLI::App app("", "dtensor_train");
  add_model_options(app, o);
  add_optimization_options(app, o);
  add_data_and_output_options(app, o);
  add_parallel_options(app, o);
  if (auto code = cli::parse(app, argc, argv, kUsage, quiet)) {
    exit_code = *code;
    return std::nullopt;
  }
  auto refuse = [&](const std::string& why) {
    exit_code = cli::usage_error(app, why, quiet);
    return std::optional<TrainOptions>();
  };
  if (!o.hf_dir.empty()) {
    // The checkpoint's config.json is the model: a flag that would change it contradicts it.
    for (const char* flag : {"--preset", "--config", "--dim", "--layers", "--heads", "--kv-heads",
                             "--ffn-dim", "--vocab"}) {
      if (app.count(flag) > 0) {
        return refuse(std::string(flag) + " contradicts --hf " + o.hf_dir + ", whose " +
                      "config.json gives the model: drop " + flag);
      }
    }
  } else if (!o.hf_out.empty()) {
    return refuse("--hf-out is where --hf writes the fine-tuned model: add --hf DIR");
  }
  if (o.min_lr && o.lr && *o.min_lr > *o.lr)
    return refuse("--min-lr (" + std::to_string(*o.min_lr) + ") is larger than --lr (" +
                  std::to_string(*o.lr) + ")");
  if (o.warmup && o.steps && *o.warmup > *o.steps)
    return refuse("--warmup (" + std::to_string(*o.warmup) + ") is longer than --steps (" +
                  std::to_string(*o.steps) + ")");
  return o;
}

}  // namespace dtensor::train
