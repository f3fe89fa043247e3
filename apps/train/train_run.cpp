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
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoints.h"
#include "common/corpus.h"
#include "common/counting_allocator.h"
#include "common/run_config.h"
#include "common/tokenizer.h"
#include "common/trainer.h"
#include "dtensor/comm/backend.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/comm/process_group.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/pp/pipeline.h"
#include "dtensor/util/error_message.h"
#include "hf_export.h"
#include "loss_plot.h"
#include "metrics.h"
#include "progress.h"
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

// "3.05 MiB", "12.5 KiB", "100 B"
std::string format_bytes(int64_t b) {
  const double v = static_cast<double>(b);
  if (b >= (int64_t{1} << 20)) return fmt("%.2f MiB", v / (1 << 20));
  if (b >= (int64_t{1} << 10)) return fmt("%.1f KiB", v / (1 << 10));
  return std::to_string(b) + " B";
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

// ", AC full" and how its recompute gets the collectives' results; empty without AC.
std::string ac_description(const RunConfig& c) {
  if (c.ac == "none") return "";
  return ", AC " + c.ac + (c.ac_replay_collectives ? "" : " (collectives re-issued in backward)");
}

std::string model_line(const RunConfig& c) {
  const auto& m = c.model;
  std::ostringstream s;
  s << c.model_source << ": dim " << m.dim << ", " << m.n_layers << " layers, " << m.n_heads
    << " heads (" << m.kv_heads() << " KV), ffn " << m.hidden_dim() << ", vocab " << m.vocab_size
    << ", " << fmt("%.2fM", static_cast<double>(m.num_parameters()) / 1e6) << " parameters";
  return s.str();
}

// The layout in short: "PP=2 x FSDP=2 x TP=2", "FSDP=2", "TP=2 x DP=2", "TP=1".
std::string layout_name(const RunConfig& c) {
  std::vector<std::string> parts;
  if (c.pp > 1) parts.push_back("PP=" + std::to_string(c.pp));
  if (c.fsdp) parts.push_back("FSDP=" + std::to_string(c.dp));
  if (c.tp > 1 || parts.empty()) parts.push_back("TP=" + std::to_string(c.tp));
  if (!c.fsdp && c.dp > 1) parts.push_back("DP=" + std::to_string(c.dp));
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : " x ") + p;
  return out;
}

// ", layout-invariant (...)" under --layout-invariant P: what the same bits hold across.
std::string invariant_description(const RunConfig& c) {
  if (c.layout_invariant == 0) return "";
  std::string degrees;
  for (int64_t d = 1; d <= c.layout_invariant; d *= 2)
    degrees += (degrees.empty()              ? ""
                : d * 2 > c.layout_invariant ? " and "
                                             : ", ") +
               std::to_string(d);
  return ", layout-invariant (" + std::to_string(c.layout_invariant) +
         " segments: the same bits at TP " + degrees + ", dp_shard 1 and " +
         std::to_string(kLayoutInvariantBatchSegments) + ", any pp)";
}

std::string pipeline_line(const RunConfig& c, int64_t threads) {
  std::ostringstream s;
  const std::string dp = c.fsdp ? " x FSDP=" : " x DP=";
  s << "PP=" << c.pp << (c.dp > 1 ? dp + std::to_string(c.dp) : std::string()) << " x TP=" << c.tp
    << " (blocks per stage ";
  const int64_t stages = c.pp * c.virtual_stages;
  for (int64_t k = 0; k < stages; ++k) {
    const auto [first, end] = pp::stage_layer_range(c.model.n_layers, k, stages);
    s << (k ? " + " : "") << end - first;
  }
  s << "; schedule " << c.pp_schedule;
  if (c.virtual_stages > 1) s << " (" << c.virtual_stages << " stages per rank, round-robin)";
  s << ", " << c.microbatches << " micro-batch" << (c.microbatches > 1 ? "es" : "") << " of "
    << c.batch_size / (c.dp * c.microbatches) << ", bubble (pp-1)/("
    << (c.virtual_stages > 1 ? "v" : "") << "M+pp-1) = " << fmt("%.0f%%", 100 * c.bubble_formula())
    << ")";
  if (c.tp > 1) {
    s << ", TP inside stages (no sequence parallel, "
      << (c.loss_parallel ? "loss parallel" : "gathered logits") << ")";
  }
  s << invariant_description(c) << ac_description(c);
  s << " on " << c.world_size << " CPU ranks, " << threads << " thread" << (threads > 1 ? "s" : "")
    << " each, " << (c.dtype == c10::kDouble ? "float64" : "float32") << ", collectives on "
    << dtensor::comm::cpu_backend_name();
  return s.str();
}

// --ep: "EP=2 over the TP ranks: 2 of 4 experts per rank, dropless dispatch".
std::string experts_line(const RunConfig& c) {
  const int64_t experts = c.model.moe->options.num_experts;
  std::ostringstream s;
  s << "EP=" << c.ep << " over the TP ranks: " << experts / c.ep << " of " << experts
    << " experts per rank, " << models::moe_dispatch_name(c.expert_parallel.dispatch)
    << " dispatch";
  if (c.expert_parallel.dispatch == models::MoeDispatch::kCapacity)
    s << " (capacity factor " << c.expert_parallel.capacity_factor << ")";
  return s.str();
}

std::string parallel_line(const RunConfig& c, int64_t threads) {
  if (c.pp > 1) return pipeline_line(c, threads);
  std::ostringstream s;
  if (c.fsdp) {
    s << "FSDP=" << c.dp << " (parameters, gradients and AdamW state sharded over " << c.dp
      << " ranks; a block's parameters gathered while it runs)";
    if (c.tp > 1) {
      s << " x TP=" << c.tp << " ("
        << (c.sequence_parallel ? "sequence parallel" : "no sequence parallel") << ", "
        << (c.loss_parallel ? "loss parallel" : "gathered logits") << ")";
    }
    s << invariant_description(c) << ac_description(c);
    if (c.bf16)
      s << ", mixed precision bf16 (float32 parameters and AdamW state, bfloat16 all-gathers and "
           "compute, float32 reduce-scatters)";
    s << " on " << c.world_size << " CPU ranks, " << threads << " thread"
      << (threads > 1 ? "s" : "") << " each, " << (c.dtype == c10::kDouble ? "float64" : "float32")
      << ", collectives on " << dtensor::comm::cpu_backend_name();
    return s.str();
  }
  s << "TP=" << c.tp;
  if (c.plan) {
    s << " (plan " << c.plan->path << ")";
  } else if (c.tp > 1 || c.layout_invariant > 0) {
    s << " (" << (c.sequence_parallel ? "sequence parallel" : "no sequence parallel") << ", "
      << (c.loss_parallel ? "loss parallel" : "gathered logits") << ")";
  }
  s << invariant_description(c) << ac_description(c);
  s << (c.dp > 1 ? " x DP=" + std::to_string(c.dp) : std::string())
    << (c.cp > 1 ? " x CP=" + std::to_string(c.cp) : std::string()) << " on " << c.world_size
    << " CPU rank" << (c.world_size > 1 ? "s" : "") << ", " << threads << " thread"
    << (threads > 1 ? "s" : "") << " each, " << (c.dtype == c10::kDouble ? "float64" : "float32");
  if (c.world_size > 1) s << ", collectives on " << dtensor::comm::cpu_backend_name();
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

// One run, step by step: set up (data, ranks, model, resume), train, finish (checkpoint, plot,
// sample), report, and optionally verify against one device.
class TrainingRun {
 public:
  TrainingRun(const TrainOptions& o, const comm::LaunchEnv& env, RunConfig cfg,
              TextTokenizer tokenizer, Clock::time_point wall_start)
      : o_(o),
        cfg_(std::move(cfg)),
        rank0_(env.rank == 0),
        wall_start_(wall_start),
        tokenizer_(std::move(tokenizer)),
        split_(read_tokens(o, cfg_, tokenizer_)),
        train_batches_(&split_.train, cfg_.batch_size, cfg_.seq_len, cfg_.seed, kTrainStream,
                       cfg_.pack_documents ? &split_.train_starts : nullptr),
        val_batches_(&split_.val, cfg_.batch_size, cfg_.seq_len, cfg_.seed, kValStream,
                     cfg_.pack_documents ? &split_.val_starts : nullptr),
        trainer_(cfg_, join_ranks(env, cfg_)),
        out_dir_(o.out_dir),
        checkpoints_((out_dir_ / "checkpoints").string(), static_cast<int>(o.keep_ckpts)),
        tty_(o.progress == "bar" || (o.progress == "auto" && ProgressBar::stderr_is_tty())),
        log_every_(o.log_every > 0 ? o.log_every : std::max<int64_t>(1, cfg_.steps / 20)),
        bar_(rank0_ ? std::cerr : null_stream_, tty_, log_every_) {}

  int run() {
    prepare_output_and_resume();
    if (rank0_) print_header();
    if (const int status = train(); status != 0) return status;
    finish_training();
    if (!cfg_.hf_dir.empty()) export_hf();
    const std::string sample = generate_sample();
    if (rank0_) print_summary(sample);
    return o_.verify_tp1 && rank0_ ? verify_tp1() : 0;
  }

 private:
  // The text's tokens, with --pack-documents encoded document by document.
  static TokenSplit read_tokens(const TrainOptions& o, const RunConfig& cfg,
                                const TextTokenizer& tokenizer) {
    const std::string text = o.data_path.empty() ? default_corpus() : read_text_file(o.data_path);
    if (!cfg.pack_documents)
      return split_tokens(tokenizer.encode(text), o.val_fraction, cfg.seq_len);
    std::vector<std::vector<int64_t>> documents;
    for (const std::string& d : split_documents(text)) documents.push_back(tokenizer.encode(d));
    return split_document_tokens(documents, o.val_fraction, cfg.seq_len);
  }

  // The ranks meet here (every rank has read the same data first). Alone (no launcher
  // variables) any free port does for the store.
  static DeviceMesh join_ranks(const comm::LaunchEnv& env, const RunConfig& cfg) {
    if (env.world_size == 1 && env.source == "default" && std::getenv("MASTER_PORT") == nullptr) {
      ::setenv("MASTER_PORT", "0", 1);
    }
    comm::init_process_group();
    return make_train_mesh(cfg);
  }

  void prepare_output_and_resume() {
    if (rank0_) {
      fs::create_directories(out_dir_);
      std::ofstream(out_dir_ / "config.json") << cfg_.to_json();
    }
    if (o_.resume) {
      const Resumed resumed = resume_training(*o_.resume, checkpoints_, trainer_);
      resumed_from_ = resumed.path;
      start_step_ = resumed.step;
      if (start_step_ > cfg_.steps) {
        throw std::runtime_error("checkpoint " + resumed_from_ + " is at step " +
                                 std::to_string(start_step_) + ", beyond --steps " +
                                 std::to_string(cfg_.steps));
      }
    }
    // The single-device check starts where this run starts.
    if (o_.verify_tp1 && rank0_) reference_.emplace(make_reference_trainer(cfg_, resumed_from_));
    if (rank0_) {
      metrics_.emplace((out_dir_ / "metrics.csv").string(), o_.resume ? start_step_ : -1);
    }
  }

  // Per rank: the parameters this rank holds, their gradients and AdamW's two moments (the same
  // size each), before the first step allocates the last three.
  std::string memory_line() const {
    const int64_t p = trainer_.parameter_bytes_per_rank();
    return "per rank " + format_bytes(4 * p) + ": parameters " + format_bytes(p) + " + gradients " +
           format_bytes(p) + " + AdamW state " + format_bytes(2 * p) +
           (cfg_.fsdp && cfg_.tp == 1 ? " (1/" + std::to_string(cfg_.dp) + " of the model's)"
                                      : std::string());
  }

  // --cp: the token slots each rank holds and the balance of the attention work over the cp
  // ranks (max / mean attended pairs) on the first batch, beside the head-tail split's.
  std::string context_line() const {
    const Batch b = train_batches_.get(start_step_);
    const int64_t rows = b.inputs.size(0), seq = b.inputs.size(1);
    const cp::ContextLayout head_tail = cp::head_tail_layout(rows, seq, cfg_.cp, b.documents);
    const cp::ContextLayout layout =
        b.documents.defined() ? cp::balanced_layout(b.documents, cfg_.cp) : head_tail;
    std::ostringstream s;
    s << "CP=" << cfg_.cp << " (" << (cfg_.cp_rotate == "ring" ? "ring" : "all-gather")
      << " of keys and values); per rank " << rows << " x " << layout.local_len()
      << " token slots of the " << rows << " x " << seq << " batch (activations about 1/" << cfg_.cp
      << " of one device's); " << (b.documents.defined() ? "packed documents, " : "")
      << fmt("balance max/mean %.4f", layout.imbalance());
    if (b.documents.defined()) s << fmt(" (head-tail %.4f)", head_tail.imbalance());
    s << " on the first batch";
    return s.str();
  }

  void print_header() const {
    std::printf("dtensor_train\n");
    print_row("model", model_line(cfg_));
    print_row("parallelism", parallel_line(cfg_, o_.threads));
    if (cfg_.ep > 1) print_row("experts", experts_line(cfg_));
    print_row("memory", memory_line());
    if (cfg_.cp > 1) print_row("context", context_line());
    print_row("data", (o_.data_path.empty() ? std::string("built-in corpus") : o_.data_path) +
                          ": " + grouped(static_cast<int64_t>(split_.train.size())) + " train / " +
                          grouped(static_cast<int64_t>(split_.val.size())) +
                          " validation tokens (" + tokenizer_.describe() + ")");
    print_row("schedule", std::to_string(cfg_.steps) + " steps of " +
                              std::to_string(cfg_.batch_size) + " x " +
                              std::to_string(cfg_.seq_len) + " tokens, AdamW lr " +
                              fmt("%.2g", cfg_.schedule.lr) + " (warmup " +
                              std::to_string(cfg_.schedule.warmup) + ", cosine to " +
                              fmt("%.2g", cfg_.schedule.min_lr) + "), weight decay " +
                              fmt("%g", cfg_.weight_decay) + ", clip " + fmt("%g", cfg_.grad_clip));
    if (!resumed_from_.empty()) {
      print_row("resumed", resumed_from_ + " (step " + std::to_string(start_step_) + ")");
    }
    std::fflush(stdout);
  }

  void save(int64_t steps_done) {
    const auto t = Clock::now();
    const std::string path =
        save_training_checkpoint(checkpoints_, trainer_, steps_done, cfg_.to_json());
    ckpt_s_ += seconds_since(t);
    last_ckpt_step_ = steps_done;
    bar_.message("checkpoint " + path);
  }

  double evaluate() {
    const auto t = Clock::now();
    last_val_ = trainer_.evaluate(val_batches_, cfg_.eval_batches);
    eval_s_ += seconds_since(t);
    return last_val_;
  }

  // Returns 0, or 4 when the loss stops being finite.
  int train() {
    for (int64_t step = start_step_; step < cfg_.stop_at; ++step) {
      const Batch batch = train_batches_.get(step);
      // The run's second step (its first when it has one) is measured by the CPU allocator:
      // the first allocates AdamW's moments, which then belong to the state.
      CountingAllocator* memory = nullptr;
      if (step == std::min(start_step_ + 1, cfg_.stop_at - 1)) {
        memory = &CountingAllocator::of(c10::DeviceType::CPU);
        memory->install();
        memory->set_origin();
      }
      const auto t0 = Clock::now();
      const StepStats s = trainer_.train_step(step, batch);
      const double dt = seconds_since(t0);
      if (memory) {
        memory->restore();
        report_step_peak(step, memory->peak());
      }
      train_s_ += dt;
      step_seconds_.push_back(dt);
      losses_.push_back(s.loss);
      if (!std::isfinite(s.loss)) {
        bar_.finish();
        if (rank0_) {
          std::cerr << "dtensor_train: the loss is " << s.loss << " at step " << step + 1 << " (lr "
                    << s.lr << "): training diverged; try a smaller --lr or --grad-clip"
                    << std::endl;
        }
        return 4;
      }
      record_step(step, s, dt);
      if (o_.ckpt_every > 0 && (step + 1) % o_.ckpt_every == 0) save(step + 1);
    }
    bar_.finish();
    return 0;
  }

  // The most a rank allocated during the measured step beyond what it held at its start, over
  // the ranks (one all_reduce), on the progress display and in the summary.
  void report_step_peak(int64_t step, int64_t bytes) {
    at::Tensor v = at::tensor({static_cast<double>(bytes)}, at::kDouble);
    step_peak_bytes_ = static_cast<int64_t>(
        comm::all_reduce(v, ReduceOp::Max, *comm::world_group()).item<double>());
    step_peak_at_ = step + 1;
    bar_.message("step " + std::to_string(step_peak_at_) + " allocated " + step_peak_text());
  }
  std::string step_peak_text() const {
    return "up to " + format_bytes(step_peak_bytes_) +
           " per rank beyond the state (activations, gradients, gathered FSDP parameters, "
           "temporaries; the largest rank in step " +
           std::to_string(step_peak_at_) + ")";
  }

  // Metrics row (with a validation loss when one is due) and the progress display.
  void record_step(int64_t step, const StepStats& s, double dt) {
    MetricsRow row;
    row.step = step + 1;
    row.loss = s.loss;
    row.lr = s.lr;
    row.step_ms = dt * 1e3;
    row.tokens_per_s = static_cast<double>(cfg_.tokens_per_step()) / dt;
    row.grad_norm = s.grad_norm;
    const bool last = step + 1 == cfg_.stop_at;
    if (last || (cfg_.eval_every > 0 && (step + 1) % cfg_.eval_every == 0)) {
      row.val_loss = evaluate();
      bar_.message("step " + std::to_string(step + 1) + ": validation loss " +
                   fmt("%.4f", last_val_));
    }
    if (metrics_) metrics_->write(row);

    // Rate and ETA from the recent steps: the first ones are slower (allocations, caches).
    const size_t recent = std::min<size_t>(step_seconds_.size(), 10);
    const double recent_s = std::accumulate(step_seconds_.end() - recent, step_seconds_.end(), 0.0);
    const double mean_step = recent_s / static_cast<double>(recent);
    const double rate = static_cast<double>(cfg_.tokens_per_step()) / mean_step;
    const double eta = mean_step * static_cast<double>(cfg_.stop_at - step - 1);
    ProgressState state{step + 1, cfg_.stop_at, s.loss, rate, s.lr, eta};
    state.bubble = s.bubble;
    state.routing = routing_summary(step + 1, s);
    state.bubble_formula = cfg_.bubble_formula();
    if (!std::isnan(s.bubble)) bubbles_.push_back(s.bubble);
    bar_.update(state);
  }

  // With experts: the mean auxiliary loss and the fewest and most tokens an expert got (summed
  // over the sparse layers) over the steps since the last logged line, as text for the line of
  // step `done` when one is printed there (the progress bar's rule), else "" (and kept adding).
  std::string routing_summary(int64_t done, const StepStats& s) {
    if (!s.tokens_per_expert.defined()) return "";
    routing_tokens_ = routing_tokens_.defined() ? routing_tokens_ + s.tokens_per_expert
                                                : s.tokens_per_expert.clone();
    routing_aux_ += s.aux_loss;
    ++routing_steps_;
    const bool line = done % log_every_ == 0 || done == cfg_.stop_at || done == 1;
    if (!line && !tty_) return "";
    const std::string text = fmt("  aux %.4f", routing_aux_ / static_cast<double>(routing_steps_)) +
                             "  tokens/expert " +
                             std::to_string(routing_tokens_.min().item<int64_t>()) + ".." +
                             std::to_string(routing_tokens_.max().item<int64_t>());
    if (line) {
      routing_tokens_ = at::Tensor();
      routing_aux_ = 0;
      routing_steps_ = 0;
    }
    return text;
  }

  void finish_training() {
    if (o_.final_ckpt && !losses_.empty() && last_ckpt_step_ != cfg_.stop_at) save(cfg_.stop_at);
    if (losses_.empty()) evaluate();
    if (rank0_ && metrics_) {
      write_loss_curve_svg((out_dir_ / "loss.svg").string(), metrics_->rows(),
                           "dtensor_train: " + cfg_.model_source + ", " + layout_name(cfg_));
    }
  }

  // --hf: the trained model as a Hugging Face directory (collective).
  void export_hf() {
    const auto t = Clock::now();
    hf_out_ = o_.hf_out.empty() ? (out_dir_ / "hf").string() : o_.hf_out;
    const auto copied = export_hf_checkpoint(trainer_, hf_out_);
    hf_s_ = seconds_since(t);
    if (rank0_) {
      std::string files;
      for (const auto& f : copied) files += (files.empty() ? "" : ", ") + f;
      std::printf("hf export: %s (config.json, model.safetensors%s%s) in %.1f s\n", hf_out_.c_str(),
                  files.empty() ? "" : ", ", files.c_str(), hf_s_);
      std::fflush(stdout);
    }
  }

  // A sample of what the model writes now (every rank takes part in the forward passes).
  std::string generate_sample() {
    if (o_.sample_chars <= 0) return "";
    const std::vector<int64_t> prompt(split_.val.begin(),
                                      split_.val.begin() + std::min<int64_t>(16, cfg_.seq_len));
    return tokenizer_.decode(prompt) +
           tokenizer_.decode(
               trainer_.generate(prompt, o_.sample_chars, 0.8, cfg_.seed, tokenizer_.vocab_size()));
  }

  void print_summary(const std::string& sample) const {
    std::printf("\nsummary\n");
    print_row("model", model_line(cfg_));
    print_row("parallelism", parallel_line(cfg_, o_.threads));
    if (!losses_.empty()) {
      print_row("memory",
                "per rank " + format_bytes(trainer_.state_bytes_per_rank()) +
                    " of parameters, gradients and AdamW state after the last step" +
                    (step_peak_at_ > 0 ? "; a step allocates " + step_peak_text() : std::string()));
      const int64_t tokens = cfg_.tokens_per_step();
      print_row("steps", std::to_string(start_step_ + 1) + " to " + std::to_string(cfg_.stop_at) +
                             " of " + std::to_string(cfg_.steps) + ", " + grouped(tokens) +
                             " tokens each (" +
                             grouped(tokens * static_cast<int64_t>(losses_.size())) + " tokens)");
      print_row("loss", fmt("%.4f", losses_.front()) + " -> " + fmt("%.4f", losses_.back()) +
                            " (validation " + fmt("%.4f", last_val_) + ")");
      const double med = median(step_seconds_);
      print_row("throughput", format_count(static_cast<double>(tokens) / med) + " tokens/s, " +
                                  fmt("%.1f", med * 1e3) + " ms/step (median)");
      if (!bubbles_.empty()) {
        print_row("bubble", fmt("%.1f%%", 100 * median(bubbles_)) +
                                " of the pipeline step idle (median over steps of the mean over "
                                "stages; " +
                                cfg_.pp_schedule + " formula (pp-1)/(" +
                                (cfg_.virtual_stages > 1 ? "v" : "") +
                                "M+pp-1) = " + fmt("%.1f%%", 100 * cfg_.bubble_formula()) + ")");
      }
    } else {
      print_row("steps", "none: the checkpoint is at step " + std::to_string(start_step_));
      print_row("loss", "validation " + fmt("%.4f", last_val_));
    }
    print_row("time", fmt("%.1f", seconds_since(wall_start_)) + " s: " + fmt("%.1f", train_s_) +
                          " s training, " + fmt("%.1f", eval_s_) + " s evaluation" +
                          (ckpt_s_ > 0 ? ", " + fmt("%.1f", ckpt_s_) + " s checkpoints" : "") +
                          (hf_s_ > 0 ? ", " + fmt("%.1f", hf_s_) + " s Hugging Face export" : ""));
    std::string files = (out_dir_ / "metrics.csv").string() + ", " +
                        (out_dir_ / "loss.svg").string() + ", " +
                        (out_dir_ / "config.json").string();
    if (last_ckpt_step_ >= 0) files += ", " + checkpoints_.path_for(last_ckpt_step_);
    if (!hf_out_.empty()) files += ", " + hf_out_ + "/ (Hugging Face)";
    print_row("files", files);
    if (!sample.empty()) std::printf("\nsample (temperature 0.8):\n%s\n", sample.c_str());
    std::fflush(stdout);
  }

  // Rank 0 re-runs the steps on one device; returns 3 on a mismatch.
  int verify_tp1() {
    // As many threads as a rank had: more would be faster on idle cores but, with OpenMP
    // spinning, much slower while anything else (a build) runs.
    const int64_t threads = o_.threads;
    std::printf(
        "\nverify-tp1: the same %zu steps on one device with plain LibTorch (%lld thread%s)\n",
        losses_.size(), static_cast<long long>(threads), threads > 1 ? "s" : "");
    std::fflush(stdout);
    ProgressBar vbar(std::cerr, tty_,
                     std::max<int64_t>(1, static_cast<int64_t>(losses_.size()) / 4));
    const auto t = Clock::now();
    const auto report = verify_against_one_device(
        *reference_, train_batches_, losses_, start_step_, cfg_.verify_rtol,
        [&](int64_t done, int64_t total, double loss) {
          const double per_step = seconds_since(t) / static_cast<double>(done);
          vbar.update({done, total, loss, static_cast<double>(cfg_.tokens_per_step()) / per_step,
                       cfg_.schedule.at(start_step_ + done - 1),
                       per_step * static_cast<double>(total - done)});
        });
    vbar.finish();
    std::ostringstream table;
    print_verify_report(table, report, layout_name(cfg_));
    std::printf("%s", table.str().c_str());
    std::printf("verify-tp1: %.1f s\n", seconds_since(t));
    std::fflush(stdout);
    return report.passed ? 0 : 3;
  }

  const TrainOptions& o_;
  const RunConfig cfg_;
  const bool rank0_;
  const Clock::time_point wall_start_;
  // Data: identical on every rank, so no rank needs to send batches to another.
  const TextTokenizer tokenizer_;
  const TokenSplit split_;
  const BatchSampler train_batches_, val_batches_;
  Trainer trainer_;
  const fs::path out_dir_;
  checkpoint::CheckpointManager checkpoints_;
  int64_t start_step_ = 0;
  std::string resumed_from_;
  std::optional<Trainer> reference_;
  std::optional<MetricsWriter> metrics_;
  const bool tty_;
  const int64_t log_every_;  // steps between logged lines
  std::ostream null_stream_{nullptr};
  ProgressBar bar_;

  std::vector<double> losses_, step_seconds_, bubbles_;
  int64_t step_peak_bytes_ = 0, step_peak_at_ = 0;  // see report_step_peak
  double last_val_ = std::numeric_limits<double>::quiet_NaN();
  double train_s_ = 0, eval_s_ = 0, ckpt_s_ = 0, hf_s_ = 0;
  // routing_summary's sums since the last logged line.
  at::Tensor routing_tokens_;
  double routing_aux_ = 0;
  int64_t routing_steps_ = 0;
  std::string hf_out_;
  int64_t last_ckpt_step_ = -1;
};

// --hf: the checkpoint's own tokenizer, whose ids must all have an embedding row.
TextTokenizer hf_tokenizer(const RunConfig& cfg) {
  const std::string path = (fs::path(cfg.hf_dir) / "tokenizer.json").string();
  TextTokenizer t;
  try {
    t = TextTokenizer::from_hf_file(path);
  } catch (const std::exception& e) {
    throw std::invalid_argument("--hf: " + util::error_message(e));
  }
  if (t.vocab_size() > cfg.model.vocab_size) {
    throw std::invalid_argument("--hf: " + path + " has " + std::to_string(t.vocab_size()) +
                                " tokens, more than the vocab_size " +
                                std::to_string(cfg.model.vocab_size) + " of " + cfg.hf_dir +
                                "/config.json");
  }
  return t;
}

}  // namespace

int run_training(const TrainOptions& o, const comm::LaunchEnv& env) {
  const auto wall_start = Clock::now();
  RunConfig cfg;
  TextTokenizer tokenizer;
  try {
    cfg = resolve_run_config(o, env.world_size);
    if (!cfg.hf_dir.empty()) tokenizer = hf_tokenizer(cfg);
  } catch (const std::exception& e) {
    // The same on every rank, decided before any rank meets another: rank 0 explains.
    if (env.rank == 0) std::cerr << "dtensor_train: " << util::error_message(e) << std::endl;
    return 2;
  }
  if (o.print_plan) {
    // The plan this launch would apply, as a --plan file: the file's own, or the built-in one
    // for its TP degree and options (models::tensor_parallel_plan).
    if (env.rank != 0) return 0;
    if (cfg.plan) {
      std::cout << plan_file_json(cfg.plan->plan, cfg.plan->sequence_parallel);
    } else {
      const models::TensorParallelOptions tp = parallelize_options(cfg).tp;
      std::cout << plan_file_json(models::tensor_parallel_plan(cfg.model, cfg.tp, tp),
                                  tp.sequence_parallel);
    }
    return 0;
  }
  at::set_num_threads(static_cast<int>(o.threads));
  return TrainingRun(o, env, std::move(cfg), std::move(tokenizer), wall_start).run();
}

}  // namespace dtensor::train
