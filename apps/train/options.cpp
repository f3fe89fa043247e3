#include "options.h"

#include <charconv>
#include <cmath>
#include <functional>
#include <iostream>
#include <map>
#include <string_view>

namespace dtensor::train {

const char* const kUsage = R"(usage: dtensor_train [options]

Trains the bundled Llama-style model with tensor parallelism over all ranks of the launch
(TP degree = number of ranks), on the built-in text or a file, with AdamW and a warmup +
cosine learning-rate schedule. Rank 0 shows progress on stderr and writes metrics.csv,
loss.svg and checkpoints to --out.

  build/apps/dtrun/dtrun -n 2 build/apps/train/dtensor_train --preset demo --verify-tp1

Also runs under torchrun --no-python, srun or mpirun (ranks meet through their environment
variables) and alone as one rank.

model:
  --preset NAME          tiny | demo | bench (default demo)
  --config FILE          model config as JSON (LlamaConfig fields), replaces the preset
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
  --seed N               seed of the weights and the batches (default 1234)

data:
  --data FILE            train on this text file (default: the built-in corpus)
  --val-fraction X       held-out tail of the text for validation (default 0.1)

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
  --sample N             after training, print N characters generated from the model

parallelism and numerics:
  --no-sequence-parallel keep activations replicated between blocks
  --no-loss-parallel     gather the logits instead of a vocab-parallel cross entropy
  --dp N                 data-parallel degree; ranks form a dp x tp mesh (default 1)
  --dtype T              float32 | float64 (default float32)
  --threads N            intra-op threads per rank (default 1)
  --verify-tp1           afterwards re-run the same steps on one device with plain LibTorch
                         and compare the losses; exit 3 on a mismatch
  --verify-rtol X        relative tolerance of that check (default 1e-4; 1e-9 in float64)

  -h, --help             print this help
)";

namespace {

template <typename T>
bool parse_number(std::string_view text, T& out) {
  if constexpr (std::is_floating_point_v<T>) {
    // from_chars rejects a leading '+', accepts "inf"/"nan": ask for finite numbers only.
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
    return ec == std::errc() && end == text.data() + text.size() && std::isfinite(out);
  } else {
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
    return ec == std::errc() && end == text.data() + text.size();
  }
}

}  // namespace

std::optional<TrainOptions> parse_args(int argc, char** argv, int& exit_code, bool quiet) {
  TrainOptions o;
  auto fail = [&](const std::string& msg) -> std::optional<TrainOptions> {
    if (!quiet) {
      std::cerr << "dtensor_train: " << msg << "\n(run dtensor_train --help for the options)\n";
    }
    exit_code = 2;
    return std::nullopt;
  };

  // Value setters: each checks its range and returns an error text or "".
  using Setter = std::function<std::string(std::string_view)>;
  auto integer = [](auto& field, int64_t min) -> Setter {
    return [&field, min](std::string_view v) -> std::string {
      int64_t x = 0;
      if (!parse_number(v, x)) return "expects an integer, got '" + std::string(v) + "'";
      if (x < min) return "must be at least " + std::to_string(min) + ", got " + std::string(v);
      field = x;
      return "";
    };
  };
  auto real = [](auto& field, double min, double max, bool min_open) -> Setter {
    return [&field, min, max, min_open](std::string_view v) -> std::string {
      double x = 0;
      if (!parse_number(v, x)) return "expects a number, got '" + std::string(v) + "'";
      if (x < min || x > max || (min_open && x == min)) {
        return "must be in " + std::string(min_open ? "(" : "[") + std::to_string(min) + ", " +
               std::to_string(max) + "], got " + std::string(v);
      }
      field = x;
      return "";
    };
  };
  auto text = [](std::string& field) -> Setter {
    return [&field](std::string_view v) -> std::string {
      if (v.empty()) return "expects a non-empty value";
      field = std::string(v);
      return "";
    };
  };
  auto choice = [](std::string& field, std::vector<std::string> allowed) -> Setter {
    return [&field, allowed](std::string_view v) -> std::string {
      for (const auto& a : allowed) {
        if (v == a) {
          field = a;
          return "";
        }
      }
      std::string list;
      for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
      return "expects one of " + list + ", got '" + std::string(v) + "'";
    };
  };
  constexpr double kInf = 1e300;
  const std::map<std::string, Setter, std::less<>> with_value = {
      {"--preset", choice(o.preset, {"tiny", "demo", "bench"})},
      {"--config", text(o.config_path)},
      {"--dim", integer(o.dim, 1)},
      {"--layers", integer(o.layers, 1)},
      {"--heads", integer(o.heads, 1)},
      {"--kv-heads", integer(o.kv_heads, 1)},
      {"--ffn-dim", integer(o.ffn_dim, 1)},
      {"--vocab", integer(o.vocab, 256)},
      {"--seq-len", integer(o.seq_len, 1)},
      {"--steps", integer(o.steps, 1)},
      {"--stop-at", integer(o.stop_at, 1)},
      {"--batch-size", integer(o.batch_size, 1)},
      {"--lr", real(o.lr, 0, 10, true)},
      {"--min-lr", real(o.min_lr, 0, 10, false)},
      {"--warmup", integer(o.warmup, 0)},
      {"--weight-decay", real(o.weight_decay, 0, kInf, false)},
      {"--beta1", real(o.beta1, 0, 1, false)},
      {"--beta2", real(o.beta2, 0, 1, false)},
      {"--grad-clip", real(o.grad_clip, 0, kInf, false)},
      {"--seed", integer(o.seed, 0)},
      {"--data", text(o.data_path)},
      {"--val-fraction", real(o.val_fraction, 0, 0.5, true)},
      {"--eval-every", integer(o.eval_every, 0)},
      {"--eval-batches", integer(o.eval_batches, 1)},
      {"--out", text(o.out_dir)},
      {"--ckpt-every", integer(o.ckpt_every, 0)},
      {"--keep-ckpts", integer(o.keep_ckpts, 1)},
      {"--log-every", integer(o.log_every, 1)},
      {"--progress", choice(o.progress, {"auto", "bar", "lines"})},
      {"--sample", integer(o.sample_chars, 0)},
      {"--dp", integer(o.dp, 1)},
      {"--dtype", choice(o.dtype, {"float32", "float64"})},
      {"--threads", integer(o.threads, 1)},
      {"--verify-rtol", real(o.verify_rtol, 0, 1, true)},
  };
  const std::map<std::string, std::function<void()>, std::less<>> flags = {
      {"--no-sequence-parallel", [&] { o.sequence_parallel = false; }},
      {"--no-loss-parallel", [&] { o.loss_parallel = false; }},
      {"--verify-tp1", [&] { o.verify_tp1 = true; }},
      {"--save-final", [&] { o.final_ckpt = true; }},
  };

  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      if (!quiet) std::cout << kUsage;
      exit_code = 0;
      return std::nullopt;
    }
    // --name=value is accepted as well as --name value.
    std::optional<std::string_view> inline_value;
    if (auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      inline_value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (arg == "--resume") {
      // The value is optional: "--resume" alone means auto.
      if (inline_value) {
        o.resume = std::string(*inline_value);
      } else if (i + 1 < argc && !std::string_view(argv[i + 1]).starts_with("-")) {
        o.resume = std::string(argv[++i]);
      } else {
        o.resume = "auto";
      }
      if (o.resume->empty()) return fail("--resume expects a checkpoint path or 'auto'");
      continue;
    }
    if (auto f = flags.find(arg); f != flags.end()) {
      if (inline_value) return fail(std::string(arg) + " takes no value");
      f->second();
      continue;
    }
    auto s = with_value.find(arg);
    if (s == with_value.end()) return fail("unknown option '" + std::string(argv[i]) + "'");
    std::string_view value;
    if (inline_value) {
      value = *inline_value;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return fail(std::string(arg) + " needs a value");
    }
    if (auto err = s->second(value); !err.empty()) return fail(std::string(arg) + " " + err);
  }
  if (o.min_lr && o.lr && *o.min_lr > *o.lr) {
    return fail("--min-lr (" + std::to_string(*o.min_lr) + ") is larger than --lr (" +
                std::to_string(*o.lr) + ")");
  }
  if (o.warmup && o.steps && *o.warmup > *o.steps) {
    return fail("--warmup (" + std::to_string(*o.warmup) + ") is longer than --steps (" +
                std::to_string(*o.steps) + ")");
  }
  return o;
}

}  // namespace dtensor::train
