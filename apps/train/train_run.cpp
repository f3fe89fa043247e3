#include "train_run.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "checkpoints.h"
#include "corpus.h"
#include "dtensor/mesh/device_mesh.h"
#include "loss_plot.h"
#include "metrics.h"
#include "progress.h"
#include "run_config.h"
#include "tokenizer.h"
#include "trainer.h"
#include "verify_tp1.h"

namespace dtensor::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// "1,234,567"
std::string grouped(int64_t v) {
  std::string digits = std::to_string(v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string model_line(const RunConfig& c) {
  const auto& m = c.model;
  std::ostringstream s;
  s << c.model_source << ": dim " << m.dim << ", " << m.n_layers << " layers, " << m.n_heads
    << " heads (" << m.kv_heads() << " KV), ffn " << m.hidden_dim() << ", vocab " << m.vocab_size
    << ", " << fmt("%.2fM", static_cast<double>(m.num_parameters()) / 1e6) << " parameters";
  return s.str();
}

std::string parallel_line(const RunConfig& c, int64_t threads) {
  std::ostringstream s;
  s << "TP=" << c.tp;
  if (c.tp > 1) {
    s << " (" << (c.sequence_parallel ? "sequence parallel" : "no sequence parallel") << ", "
      << (c.loss_parallel ? "loss parallel" : "gathered logits") << ")";
  }
  s << (c.dp > 1 ? " x DP=" + std::to_string(c.dp) : std::string()) << " on " << c.world_size
    << " CPU rank" << (c.world_size > 1 ? "s" : "") << ", " << threads << " thread"
    << (threads > 1 ? "s" : "") << " each, " << (c.dtype == c10::kDouble ? "float64" : "float32");
  return s.str();
}

void print_row(const std::string& key, const std::string& value) {
  std::printf("  %-12s %s\n", key.c_str(), value.c_str());
}

// Median of the step times (robust to the first steps, which warm caches up).
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace

int run_training(const TrainOptions& o, const comm::LaunchEnv& env) {
  const auto wall_start = Clock::now();
  const bool rank0 = env.rank == 0;
  RunConfig cfg;
  try {
    cfg = resolve_run_config(o, env.world_size);
  } catch (const std::exception& e) {
    // The same on every rank, decided before any rank meets another: rank 0 explains.
    if (rank0) std::cerr << "dtensor_train: " << e.what() << std::endl;
    return 2;
  }
  at::set_num_threads(static_cast<int>(o.threads));

  // Data: identical on every rank, so no rank needs to send batches to another.
  const ByteTokenizer tokenizer;
  const std::string file_text = o.data_path.empty() ? std::string() : read_text_file(o.data_path);
  const std::string& text = o.data_path.empty() ? default_corpus() : file_text;
  const TokenSplit split = split_tokens(tokenizer.encode(text), o.val_fraction, cfg.seq_len);
  const BatchSampler train_batches(&split.train, cfg.batch_size, cfg.seq_len, cfg.seed,
                                   kTrainStream);
  const BatchSampler val_batches(&split.val, cfg.batch_size, cfg.seq_len, cfg.seed, kValStream);

  // Ranks. Alone (no launcher variables) any free port does for the store.
  if (env.world_size == 1 && env.source == "default" && std::getenv("MASTER_PORT") == nullptr) {
    ::setenv("MASTER_PORT", "0", 1);
  }
  comm::init_process_group();
  const DeviceMesh mesh = cfg.dp > 1 ? init_device_mesh("cpu", {cfg.dp, cfg.tp}, {"dp", "tp"})
                                     : init_device_mesh("cpu", {cfg.tp}, {"tp"});
  Trainer trainer(cfg, mesh);

  const fs::path out_dir = o.out_dir;
  if (rank0) {
    fs::create_directories(out_dir);
    std::ofstream(out_dir / "config.json") << cfg.to_json();
  }
  checkpoint::CheckpointManager checkpoints((out_dir / "checkpoints").string(),
                                            static_cast<int>(o.keep_ckpts));

  int64_t start_step = 0;
  std::string resumed_from;
  if (o.resume) {
    const Resumed resumed = resume_training(*o.resume, checkpoints, trainer);
    resumed_from = resumed.path;
    start_step = resumed.step;
    if (start_step > cfg.steps) {
      throw std::runtime_error("checkpoint " + resumed_from + " is at step " +
                               std::to_string(start_step) + ", beyond --steps " +
                               std::to_string(cfg.steps));
    }
  }

  // The single-device check starts where this run starts.
  std::optional<Trainer> reference;
  if (o.verify_tp1 && rank0) reference.emplace(make_reference_trainer(cfg, resumed_from));

  std::optional<MetricsWriter> metrics;
  if (rank0) metrics.emplace((out_dir / "metrics.csv").string(), o.resume ? start_step : -1);
  const bool tty = o.progress == "bar" || (o.progress == "auto" && ProgressBar::stderr_is_tty());
  const int64_t log_every = o.log_every > 0 ? o.log_every : std::max<int64_t>(1, cfg.steps / 20);
  std::ostream null_stream(nullptr);
  ProgressBar bar(rank0 ? std::cerr : null_stream, tty, log_every);

  if (rank0) {
    std::printf("dtensor_train\n");
    print_row("model", model_line(cfg));
    print_row("parallelism", parallel_line(cfg, o.threads));
    print_row("data", (o.data_path.empty() ? std::string("built-in corpus") : o.data_path) + ": " +
                          grouped(static_cast<int64_t>(split.train.size())) + " train / " +
                          grouped(static_cast<int64_t>(split.val.size())) +
                          " validation tokens (bytes)");
    print_row("schedule", std::to_string(cfg.steps) + " steps of " +
                              std::to_string(cfg.batch_size) + " x " + std::to_string(cfg.seq_len) +
                              " tokens, AdamW lr " + fmt("%.2g", cfg.schedule.lr) + " (warmup " +
                              std::to_string(cfg.schedule.warmup) + ", cosine to " +
                              fmt("%.2g", cfg.schedule.min_lr) + "), weight decay " +
                              fmt("%g", cfg.weight_decay) + ", clip " + fmt("%g", cfg.grad_clip));
    if (!resumed_from.empty()) {
      print_row("resumed", resumed_from + " (step " + std::to_string(start_step) + ")");
    }
    std::fflush(stdout);
  }

  std::vector<double> losses, step_seconds;
  double first_loss = std::numeric_limits<double>::quiet_NaN(), last_loss = first_loss;
  double last_val = first_loss;
  double train_s = 0, eval_s = 0, ckpt_s = 0;
  int64_t last_ckpt_step = -1;
  auto save = [&](int64_t steps_done) {
    const auto t = Clock::now();
    const std::string path =
        save_training_checkpoint(checkpoints, trainer, steps_done, cfg.to_json());
    ckpt_s += seconds_since(t);
    last_ckpt_step = steps_done;
    bar.message("checkpoint " + path);
  };

  for (int64_t step = start_step; step < cfg.stop_at; ++step) {
    const Batch batch = train_batches.get(step);
    const auto t0 = Clock::now();
    const StepStats s = trainer.train_step(step, batch);
    const double dt = seconds_since(t0);
    train_s += dt;
    step_seconds.push_back(dt);
    losses.push_back(s.loss);
    if (std::isnan(first_loss)) first_loss = s.loss;
    last_loss = s.loss;
    if (!std::isfinite(s.loss)) {
      bar.finish();
      if (rank0) {
        std::cerr << "dtensor_train: the loss is " << s.loss << " at step " << step + 1 << " (lr "
                  << s.lr << "): training diverged; try a smaller --lr or --grad-clip" << std::endl;
      }
      return 4;
    }

    MetricsRow row;
    row.step = step + 1;
    row.loss = s.loss;
    row.lr = s.lr;
    row.step_ms = dt * 1e3;
    row.tokens_per_s = static_cast<double>(cfg.tokens_per_step()) / dt;
    row.grad_norm = s.grad_norm;
    const bool last = step + 1 == cfg.stop_at;
    if (last || (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0)) {
      const auto t = Clock::now();
      row.val_loss = trainer.evaluate(val_batches, cfg.eval_batches);
      eval_s += seconds_since(t);
      last_val = *row.val_loss;
      bar.message("step " + std::to_string(step + 1) + ": validation loss " +
                  fmt("%.4f", last_val));
    }
    if (metrics) metrics->write(row);

    // Rate and ETA from the recent steps: the first ones are slower (allocations, caches).
    const size_t recent = std::min<size_t>(step_seconds.size(), 10);
    double recent_s = 0;
    for (size_t i = step_seconds.size() - recent; i < step_seconds.size(); ++i) {
      recent_s += step_seconds[i];
    }
    const double mean_step = recent_s / static_cast<double>(recent);
    bar.update({step + 1, cfg.stop_at, s.loss,
                static_cast<double>(cfg.tokens_per_step()) / mean_step, s.lr,
                mean_step * static_cast<double>(cfg.stop_at - step - 1)});
    if (o.ckpt_every > 0 && (step + 1) % o.ckpt_every == 0) save(step + 1);
  }
  bar.finish();
  if (o.final_ckpt && !losses.empty() && last_ckpt_step != cfg.stop_at) save(cfg.stop_at);
  if (losses.empty()) {
    const auto t = Clock::now();
    last_val = trainer.evaluate(val_batches, cfg.eval_batches);
    eval_s += seconds_since(t);
  }

  if (rank0 && metrics) {
    write_loss_curve_svg((out_dir / "loss.svg").string(), metrics->rows(),
                         "dtensor_train: " + cfg.model_source + ", TP=" + std::to_string(cfg.tp) +
                             (cfg.dp > 1 ? " x DP=" + std::to_string(cfg.dp) : std::string()));
  }

  // A sample of what the model writes now (every rank takes part in the forward passes).
  std::string sample;
  if (o.sample_chars > 0) {
    const std::vector<int64_t> prompt(split.val.begin(),
                                      split.val.begin() + std::min<int64_t>(16, cfg.seq_len));
    sample = tokenizer.decode(prompt) +
             tokenizer.decode(trainer.generate(prompt, o.sample_chars, 0.8, cfg.seed));
  }

  if (rank0) {
    std::printf("\nsummary\n");
    print_row("model", model_line(cfg));
    print_row("parallelism", parallel_line(cfg, o.threads));
    if (!losses.empty()) {
      print_row("steps", std::to_string(start_step + 1) + " to " + std::to_string(cfg.stop_at) +
                             " of " + std::to_string(cfg.steps) + ", " +
                             grouped(cfg.tokens_per_step()) + " tokens each (" +
                             grouped(cfg.tokens_per_step() * static_cast<int64_t>(losses.size())) +
                             " tokens)");
      print_row("loss", fmt("%.4f", first_loss) + " -> " + fmt("%.4f", last_loss) +
                            " (validation " + fmt("%.4f", last_val) + ")");
      const double med = median(step_seconds);
      print_row("throughput", format_count(static_cast<double>(cfg.tokens_per_step()) / med) +
                                  " tokens/s, " + fmt("%.1f", med * 1e3) + " ms/step (median)");
    } else {
      print_row("steps", "none: the checkpoint is at step " + std::to_string(start_step));
      print_row("loss", "validation " + fmt("%.4f", last_val));
    }
    print_row("time", fmt("%.1f", seconds_since(wall_start)) + " s: " + fmt("%.1f", train_s) +
                          " s training, " + fmt("%.1f", eval_s) + " s evaluation" +
                          (ckpt_s > 0 ? ", " + fmt("%.1f", ckpt_s) + " s checkpoints" : ""));
    std::string files = (out_dir / "metrics.csv").string() + ", " +
                        (out_dir / "loss.svg").string() + ", " + (out_dir / "config.json").string();
    if (last_ckpt_step >= 0) files += ", " + checkpoints.path_for(last_ckpt_step);
    print_row("files", files);
    if (!sample.empty()) std::printf("\nsample (temperature 0.8):\n%s\n", sample.c_str());
    std::fflush(stdout);
  }

  int status = 0;
  if (o.verify_tp1 && rank0) {
    // As many threads as a rank had: more would be faster on idle cores but, with OpenMP
    // spinning, much slower while anything else (a build) runs.
    const int64_t verify_threads = o.threads;
    std::printf(
        "\nverify-tp1: the same %zu steps on one device with plain LibTorch (%lld thread%s)\n",
        losses.size(), static_cast<long long>(verify_threads), verify_threads > 1 ? "s" : "");
    std::fflush(stdout);
    ProgressBar vbar(std::cerr, tty, std::max<int64_t>(1, static_cast<int64_t>(losses.size()) / 4));
    const auto t = Clock::now();
    const auto report = verify_against_one_device(
        *reference, train_batches, losses, start_step, cfg.verify_rtol,
        [&](int64_t done, int64_t total, double loss) {
          const double per_step = seconds_since(t) / static_cast<double>(done);
          vbar.update({done, total, loss, static_cast<double>(cfg.tokens_per_step()) / per_step,
                       cfg.schedule.at(start_step + done - 1),
                       per_step * static_cast<double>(total - done)});
        });
    vbar.finish();
    std::ostringstream table;
    print_verify_report(table, report, cfg.tp);
    std::printf("%s", table.str().c_str());
    std::printf("verify-tp1: %.1f s\n", seconds_since(t));
    std::fflush(stdout);
    if (!report.passed) status = 3;
  }
  return status;
}

}  // namespace dtensor::train
