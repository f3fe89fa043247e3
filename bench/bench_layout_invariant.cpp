// bench_layout_invariant: what LayoutInvariantMode costs, and that it keeps a training run the
// same bits at TP=1 and TP=2.
//
//   build/bench/bench_layout_invariant [--preset demo] [--batch 4] [--seq 64] [--rounds 5]
//   scripts/bench layout_invariant
//
// Runs TP=1 (one process) and then TP=2 (two ranks over Gloo on 127.0.0.1). Each holds two
// copies of the same model under the Megatron plan (no sequence parallelism, logits gathered),
// one trained in the normal mode and one in the layout-invariant mode, each with its own AdamW;
// rounds alternate them (normal, invariant, invariant, normal), one training step (forward,
// cross entropy, backward, AdamW) per turn, one intra-op thread per rank. The table gives the
// median ms per step of each and their ratio; the invariant model's losses at TP=1 and TP=2 are
// compared bit for bit (the normal model's, which sum in another order, are shown beside). Then
// greedy decoding with the KV cache in each mode, as tokens/s of the decode steps.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <signal.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/cli.h"
#include "common/local_ranks.h"
#include "dtensor/dtensor.h"

namespace {

// The Megatron plan: activations replicated between blocks, logits gathered.
dtensor::models::TensorParallelOptions megatron_plan() {
  dtensor::models::TensorParallelOptions options;
  options.sequence_parallel = false;
  options.loss_parallel = false;
  return options;
}

constexpr const char* kUsage = R"(usage: bench_layout_invariant [options]

Times one training step (forward, cross entropy, backward, AdamW) of a Transformer under the
Megatron TP plan in the normal mode and in dtensor::ops::LayoutInvariantMode (max_degree 4), at
TP=1 (one process) and TP=2 (two ranks over Gloo on 127.0.0.1, started by this program), one
intra-op thread per rank, alternating the two modes in rounds; then greedy decoding (32 tokens
after a 16-token prompt) in each mode. Prints the median ms per step and decode tokens/s of each,
their ratios, and whether the invariant model's losses at TP=1 and TP=2 have the same bits.

The last line is:
  RESULT invariant_vs_normal_tp1=<step time ratio> invariant_vs_normal_tp2=<ratio>
         decode_invariant_vs_normal_tp1=<decode tokens/s ratio>
         decode_invariant_vs_normal_tp2=<ratio> losses_equal=<0|1>

options:
  --preset NAME   tiny, demo (default) or bench
  --batch N       sequences per step (default 4)
  --seq N         tokens per sequence (default 64)
  --rounds N      rounds of (normal, invariant, invariant, normal) steps (default 5)
  --help          print this help
)";

struct Options {
  std::string preset = "demo";
  int64_t batch = 4, seq = 64;
  int rounds = 5;
  std::string out;  // set by the controller for a phase's rank 0
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string hex_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  char s[16];
  std::snprintf(s, sizeof s, "%08x", bits);
  return s;
}

// One rank of one phase: both models, the rounds, and (rank 0) the phase's line in opt.out.
int run_rank(const Options& opt) {
  at::set_num_threads(1);
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  auto mesh = dtensor::init_device_mesh("cpu", {world});
  const dtensor::models::DecoderConfig config = dtensor::models::DecoderConfig::preset(opt.preset);
  struct Run {
    dtensor::models::Transformer model{nullptr};
    std::unique_ptr<torch::optim::AdamW> adamw;
    std::vector<double> ms;
    std::vector<float> losses;
    bool invariant = false;
  };
  std::vector<Run> runs(2);
  for (size_t i = 0; i < runs.size(); ++i) {
    runs[i].invariant = i == 1;
    runs[i].model = dtensor::models::Transformer(config);
    runs[i].model->init_weights(11);
    dtensor::models::apply_tensor_parallel(*runs[i].model, mesh, megatron_plan());
    runs[i].adamw = std::make_unique<torch::optim::AdamW>(runs[i].model->parameters(),
                                                          torch::optim::AdamWOptions(1e-3));
  }
  at::manual_seed(5);
  const at::Tensor tokens = at::randint(config.vocab_size, {opt.batch, opt.seq + 1});
  const at::Tensor inputs = tokens.narrow(1, 0, opt.seq), targets = tokens.narrow(1, 1, opt.seq);
  auto step = [&](Run& r, bool timed) {
    const auto start = std::chrono::steady_clock::now();
    std::optional<dtensor::ops::LayoutInvariantMode> mode;
    if (r.invariant) mode.emplace(4);
    r.adamw->zero_grad();
    at::Tensor logits = r.model->forward(inputs);
    if (dtensor::is_dtensor(logits)) logits = dtensor::full_tensor(logits);
    const at::Tensor loss = dtensor::models::loss_and_backward(logits, targets);
    r.adamw->step();
    mode.reset();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    r.losses.push_back(loss.item<float>());
    if (timed) r.ms.push_back(ms);
  };
  for (auto& r : runs) step(r, false);  // warm-up: caches, allocator
  for (int round = 0; round < opt.rounds; ++round) {
    const bool flip = round % 2 == 1;
    for (int i : {0, 1, 1, 0}) step(runs[flip ? 1 - i : i], true);
  }
  // Decode: greedy generation of 32 tokens after a 16-token prompt, each mode in turn; tokens/s
  // of the decode steps (the prefill left out).
  std::vector<double> decode[2];
  dtensor::models::GenerateOptions gen;
  gen.max_new_tokens = 32;
  const std::vector<int64_t> prompt(16, 1);
  for (int round = 0; round < opt.rounds; ++round) {
    for (int i : {0, 1, 1, 0}) {
      const int which = round % 2 == 1 ? 1 - i : i;
      std::optional<dtensor::ops::LayoutInvariantMode> mode;
      if (which == 1) mode.emplace(4);
      const auto result = dtensor::models::generate(*runs[0].model, {prompt}, gen);
      decode[which].push_back(static_cast<double>(result.decode_steps) / result.decode_seconds);
    }
  }
  if (dtensor::comm::get_rank() == 0 && !opt.out.empty()) {
    std::ofstream out(opt.out);
    out << world << " " << median(runs[0].ms) << " " << median(runs[1].ms) << " "
        << median(decode[0]) << " " << median(decode[1]);
    for (const auto& r : runs) {
      out << " ";
      for (size_t i = 0; i < r.losses.size(); ++i) out << (i ? "," : "") << hex_of(r.losses[i]);
    }
    out << "\n";
  }
  return 0;
}

struct Phase {
  int world = 0;
  double normal_ms = 0, invariant_ms = 0, normal_tps = 0, invariant_tps = 0;
  std::string normal_losses, invariant_losses;
};

int control(int argc, char** argv, const Options& opt) {
  char pattern[] = "/tmp/bench_layout_invariant_XXXXXX";
  const int fd = ::mkstemp(pattern);
  if (fd < 0) {
    std::cerr << "bench_layout_invariant: cannot create a temporary file\n";
    return 1;
  }
  ::close(fd);
  const std::string out = pattern;
  std::vector<Phase> phases;
  for (int world : {1, 2}) {
    if (int status = dtensor::bench::run_local_ranks("bench_layout_invariant", argc, argv, world,
                                                     {{"DTENSOR_BENCH_OUT", out}})) {
      ::unlink(pattern);
      return status;
    }
    std::ifstream in(out);
    Phase p;
    in >> p.world >> p.normal_ms >> p.invariant_ms >> p.normal_tps >> p.invariant_tps >>
        p.normal_losses >> p.invariant_losses;
    phases.push_back(p);
  }
  ::unlink(pattern);
  std::printf("preset %s, %" PRId64 " x %" PRId64
              " tokens, Megatron plan, Gloo, 1 thread per rank, "
              "median of %d steps each\n\n",
              opt.preset.c_str(), opt.batch, opt.seq, 2 * opt.rounds);
  std::printf("%-4s %14s %17s %7s %18s %21s %7s\n", "TP", "normal ms/step", "invariant ms/step",
              "ratio", "normal decode t/s", "invariant decode t/s", "ratio");
  for (const Phase& p : phases)
    std::printf("%-4d %14.2f %17.2f %7.3f %18.1f %21.1f %7.3f\n", p.world, p.normal_ms,
                p.invariant_ms, p.invariant_ms / p.normal_ms, p.normal_tps, p.invariant_tps,
                p.invariant_tps / p.normal_tps);
  const bool equal = phases[0].invariant_losses == phases[1].invariant_losses;
  std::printf(
      "\nlosses (float32 bits, %d steps), invariant mode: TP=1 %s\n"
      "                                          TP=2 %s\n"
      "normal mode:                               TP=1 %s\n"
      "                                          TP=2 %s\n",
      1 + 2 * opt.rounds, phases[0].invariant_losses.c_str(), phases[1].invariant_losses.c_str(),
      phases[0].normal_losses.c_str(), phases[1].normal_losses.c_str());
  std::printf(
      "\nRESULT invariant_vs_normal_tp1=%.3f invariant_vs_normal_tp2=%.3f "
      "decode_invariant_vs_normal_tp1=%.3f decode_invariant_vs_normal_tp2=%.3f losses_equal=%d\n",
      phases[0].invariant_ms / phases[0].normal_ms, phases[1].invariant_ms / phases[1].normal_ms,
      phases[0].invariant_tps / phases[0].normal_tps,
      phases[1].invariant_tps / phases[1].normal_tps, equal ? 1 : 0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app("", "bench_layout_invariant");
  app.add_option("--preset", opt.preset)->check(dtensor::cli::one_of({"tiny", "demo", "bench"}));
  app.add_option("--batch", opt.batch)->check(dtensor::cli::integer(1));
  app.add_option("--seq", opt.seq)->check(dtensor::cli::integer(1));
  app.add_option("--rounds", opt.rounds)->check(dtensor::cli::integer(1, 1000));
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) return *code;
  try {
    if (std::getenv("RANK") == nullptr) return control(argc, argv, opt);
    if (const char* out = std::getenv("DTENSOR_BENCH_OUT")) opt.out = out;
    return run_rank(opt);
  } catch (const c10::Error& e) {
    std::cerr << "bench_layout_invariant: " << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "bench_layout_invariant: " << e.what() << std::endl;
  }
  return 1;
}
