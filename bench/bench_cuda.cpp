// bench_cuda: a bundled preset model (Llama-shaped) on one GPU. (a) a bfloat16 training step of the plain LibTorch
// model against the same model through dtensor TP on a 1-rank CUDA mesh; (b) greedy decode
// tokens/s of generate() at TP=1 against Hugging Face transformers on the same GPU, weights and
// prompts. Run by scripts/gpu-check; prints a note and no numbers where no GPU is visible.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/record_function.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/cli.h"
#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/dispatch/cache.h"
#include "dtensor/dtensor.h"
#include "dtensor/models/generate.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/models/transformer.h"
#include "hf_generate.h"

using namespace dtensor;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kUsage = R"(usage: bench_cuda [options]

On one GPU (a 1-rank CUDA mesh, so no communication):
  (a) a training step (forward, loss, backward, AdamW) of the Llama preset in bfloat16, as the
      plain LibTorch model and as the same model under dtensor TP at TP=1, interleaved rounds;
  (b) greedy decode tokens/s of generate() at TP=1 (bfloat16, KV cache) and of Hugging Face
      transformers (bench/hf_generate.py --device cuda --dtype bfloat16) on the same weights
      and prompts; (b) leaves transformers out with a note when it cannot be imported.
Last line:
  RESULT step_ms_plain=... step_ms_tp1=... tp1_overhead_pct=<(tp1-plain)/plain*100>
         decode_tps_tp1=... decode_tps_hf=... speedup_vs_hf=<ours/hf> greedy_matches_hf=<0|1>

options:
  --preset NAME    model preset (default bench)
  --batch N        sequences per training step (default 8)
  --seq N          tokens per training sequence (default 512)
  --steps N        timed steps per variant per round (default 5)
  --rounds N       rounds (default 5; one untimed warm-up round first)
  --prompt N       tokens per decode prompt (default 128)
  --new N          new tokens per prompt (default 128)
  --python PATH    Python that runs transformers (default python3)
  --hf-script P    default bench/hf_generate.py
  --no-hf          leave transformers out
)";

struct Options {
  std::string preset = "bench";
  int64_t batch = 8, seq = 512, prompt = 128, new_tokens = 128;
  int steps = 5, rounds = 5;
  std::string python = "python3", hf_script = "bench/hf_generate.py";
  bool hf = true;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

models::Transformer make_model(const Options& o, const DeviceMesh* tp_mesh) {
  models::Transformer m(models::DecoderConfig::preset(o.preset));
  m->init_weights(0);  // on the CPU: the same weights in every variant and in the HF copy
  m->to(at::kCUDA, at::kBFloat16);
  if (tp_mesh) models::apply_tensor_parallel(*m, *tp_mesh);
  return m;
}

// What one step of a variant launches and what its host side costs: where a gap to plain
// LibTorch comes from (the CPU issuing more or slower work, or the GPU running more kernels).
struct StepShape {
  double host_ms = 0;  // the CPU's time to issue a step, without waiting for the GPU
  int64_t aten_ops = 0, dtensor_ops = 0, collectives = 0;
};

struct StepResult {
  double ms_plain = 0, ms_tp1 = 0, first_loss_plain = 0, first_loss_tp1 = 0;
  StepShape plain, tp1;
};

// ATen ops one call of `f` runs (every op, nested ones too).
int64_t count_aten_ops(const std::function<void()>& f) {
  static std::atomic<int64_t> n{0};
  n = 0;
  const auto handle =
      at::addGlobalCallback(at::RecordFunctionCallback([](const at::RecordFunction&)
                                                           -> std::unique_ptr<at::ObserverContext> {
                              n.fetch_add(1, std::memory_order_relaxed);
                              return nullptr;
                            }).scopes({at::RecordScope::FUNCTION}));
  f();
  at::removeCallback(handle);
  return n.load();
}

StepResult time_steps(const Options& o, const DeviceMesh& mesh) {
  struct Variant {
    models::Transformer model{nullptr};
    std::unique_ptr<torch::optim::AdamW> opt;
    std::vector<double> ms;
    double first_loss = 0;
  };
  Variant v[2];
  for (int i = 0; i < 2; ++i) {
    v[i].model = make_model(o, i == 0 ? nullptr : &mesh);
    v[i].opt = std::make_unique<torch::optim::AdamW>(v[i].model->parameters(),
                                                     torch::optim::AdamWOptions(1e-4));
  }
  const int64_t vocab = v[0].model->config().vocab_size;
  at::manual_seed(0);
  const auto tokens = at::randint(vocab, {o.batch, o.seq}, at::kLong).to(at::kCUDA);
  const auto targets = at::randint(vocab, {o.batch, o.seq}, at::kLong).to(at::kCUDA);
  auto step = [&](Variant& x) {
    x.opt->zero_grad();
    at::Tensor loss = models::loss_and_backward(x.model->forward(tokens), targets);
    x.opt->step();
    return loss;
  };
  std::vector<double> host[2];
  for (int r = 0; r <= o.rounds; ++r) {
    for (int i = 0; i < 2; ++i) {
      auto& x = v[i];
      torch::cuda::synchronize();
      const auto t = Clock::now();
      at::Tensor loss;
      for (int s = 0; s < o.steps; ++s) loss = step(x);
      if (r > 0) host[i].push_back(seconds_since(t) * 1e3 / o.steps);
      torch::cuda::synchronize();
      if (r == 0) {
        x.first_loss = (is_dtensor(loss) ? full_tensor(loss) : loss).item<double>();
      } else {
        x.ms.push_back(seconds_since(t) * 1e3 / o.steps);
      }
    }
  }
  StepShape shape[2];
  for (int i = 0; i < 2; ++i) {
    shape[i].host_ms = median(host[i]);
    const auto before = dispatch::cache_stats();
    CommDebugMode comms;
    shape[i].aten_ops = count_aten_ops([&] { step(v[i]); });
    const auto after = dispatch::cache_stats();
    shape[i].dtensor_ops = (after.hits + after.misses) - (before.hits + before.misses);
    shape[i].collectives = comms.get_total_counts();
    torch::cuda::synchronize();
  }
  return {median(v[0].ms), median(v[1].ms), v[0].first_loss, v[1].first_loss, shape[0], shape[1]};
}

std::vector<std::vector<int64_t>> make_prompts(const Options& o, int64_t vocab) {
  at::manual_seed(1);
  const at::Tensor ids = at::randint(vocab, {1, o.prompt}, at::kLong);
  return {std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + o.prompt)};
}

struct Decode {
  double tps = 0;
  std::string tokens;  // comma-separated
};

Decode time_decode(const Options& o, const DeviceMesh& mesh) {
  auto model = make_model(o, &mesh);
  const auto prompts = make_prompts(o, model->config().vocab_size);
  models::GenerateOptions g;
  g.max_new_tokens = o.new_tokens;
  std::vector<double> tps;
  Decode d;
  for (int r = 0; r <= 3; ++r) {
    const auto res = models::generate(*model, prompts, g);
    if (r == 0) continue;
    tps.push_back(static_cast<double>(res.decode_steps) / res.decode_seconds);
    d.tokens.clear();
    for (int64_t t : res.tokens.at(0))
      d.tokens += (d.tokens.empty() ? "" : ",") + std::to_string(t);
  }
  d.tps = median(tps);
  return d;
}

std::optional<Decode> time_hf(const Options& o) {
  models::Transformer model(models::DecoderConfig::preset(o.preset));
  model->init_weights(0);
  std::string why;
  const auto f = dtensor::bench::hf_generate(*model, make_prompts(o, model->config().vocab_size),
                                             o.python, o.hf_script, o.new_tokens,
                                             "--rounds 3 --device cuda --dtype bfloat16", &why);
  if (!f) {
    std::printf("transformers left out: %s\n", why.c_str());
    return std::nullopt;
  }
  Decode d;
  if (f->count("decode_tps")) d.tps = std::stod(f->at("decode_tps"));
  if (f->count("tokens")) d.tokens = f->at("tokens");
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app("", "bench_cuda");
  app.add_option("--preset", o.preset)->check(cli::one_of({"tiny", "demo", "bench"}));
  app.add_option("--batch", o.batch)->check(cli::integer(1));
  app.add_option("--seq", o.seq)->check(cli::integer(2));
  app.add_option("--steps", o.steps)->check(cli::integer(1));
  app.add_option("--rounds", o.rounds)->check(cli::integer(1));
  app.add_option("--prompt", o.prompt)->check(cli::integer(1));
  app.add_option("--new", o.new_tokens)->check(cli::integer(2));
  app.add_option("--python", o.python)->check(cli::non_empty());
  app.add_option("--hf-script", o.hf_script)->check(cli::non_empty());
  app.add_flag_callback("--no-hf", [&o] { o.hf = false; });
  if (auto code = cli::parse(app, argc, argv, kUsage)) return *code;
  if (!at::detail::getCUDAHooks().hasCUDA() || at::detail::getCUDAHooks().deviceCount() == 0) {
    std::printf(
        "bench_cuda: no CUDA device visible (CPU-only LibTorch or no GPU): nothing timed\n");
    std::printf(
        "RESULT step_ms_plain=nan step_ms_tp1=nan tp1_overhead_pct=nan decode_tps_tp1=nan "
        "decode_tps_hf=nan speedup_vs_hf=nan greedy_matches_hf=nan\n");
    return 0;
  }
  try {
    at::set_num_threads(1);
    ::setenv("RANK", "0", 0);
    ::setenv("WORLD_SIZE", "1", 0);
    ::setenv("MASTER_ADDR", "127.0.0.1", 0);
    ::setenv("MASTER_PORT", "29733", 0);
    auto mesh = init_device_mesh("cuda", {1}, {"tp"});
    const StepResult s = time_steps(o, mesh);
    const double overhead = (s.ms_tp1 - s.ms_plain) / s.ms_plain * 100.0;
    std::printf(
        "training step, preset %s, %lld x %lld tokens, bfloat16, AdamW; median of %d "
        "rounds of %d steps\n",
        o.preset.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.seq), o.rounds,
        o.steps);
    std::printf("  %-16s %9s %11s %10s %10s %9s %9s %12s\n", "", "ms/step", "tokens/s",
                "first loss", "host ms", "ATen ops", "DTensor", "collectives");
    auto row = [&](const char* name, double ms, double loss, const StepShape& sh) {
      std::printf("  %-16s %9.2f %11.0f %10.4f %10.2f %9lld %9lld %12lld\n", name, ms,
                  o.batch * o.seq / ms * 1e3, loss, sh.host_ms, static_cast<long long>(sh.aten_ops),
                  static_cast<long long>(sh.dtensor_ops), static_cast<long long>(sh.collectives));
    };
    row("plain LibTorch", s.ms_plain, s.first_loss_plain, s.plain);
    row("dtensor TP=1", s.ms_tp1, s.first_loss_tp1, s.tp1);
    std::printf(
        "  TP=1 over plain: %+.2f%%  (host ms: the CPU's time to issue a step; a step "
        "whose host ms is near its ms/step waits on the CPU)\n",
        overhead);
    std::fflush(stdout);
    const Decode ours = time_decode(o, mesh);
    const std::optional<Decode> hf = o.hf ? time_hf(o) : std::nullopt;
    std::printf("decode, prompt %lld, %lld new tokens, greedy, bfloat16, median of 3 rounds\n",
                static_cast<long long>(o.prompt), static_cast<long long>(o.new_tokens));
    std::printf("  dtensor TP=1       %9.1f tokens/s\n", ours.tps);
    if (hf) {
      std::printf("  HF transformers    %9.1f tokens/s  (greedy tokens %s ours)\n", hf->tps,
                  hf->tokens == ours.tokens ? "==" : "!=");
    } else {
      std::printf("  HF transformers    (not run)\n");
    }
    std::printf(
        "RESULT step_ms_plain=%.3f step_ms_tp1=%.3f tp1_overhead_pct=%.2f "
        "decode_tps_tp1=%.1f decode_tps_hf=%s speedup_vs_hf=%s greedy_matches_hf=%s\n",
        s.ms_plain, s.ms_tp1, overhead, ours.tps, hf ? std::to_string(hf->tps).c_str() : "nan",
        hf ? std::to_string(ours.tps / hf->tps).c_str() : "nan",
        hf ? (hf->tokens == ours.tokens ? "1" : "0") : "nan");
  } catch (const c10::Error& e) {
    std::cerr << "bench_cuda: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
  return 0;
}
