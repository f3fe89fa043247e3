// bench_captured_step: one GPU, a bfloat16 training step of a Llama preset (zero_grad, forward,
// cross entropy, backward, Partial gradients summed, clipping on the device, CapturableAdamW),
// eager and replayed as one CUDA graph (models::CapturedStep), for plain LibTorch and for
// dtensor-cpp TP on a 1-rank mesh (sequence parallel, loss parallel), side by side. Each variant
// trains `--steps` steps from the same weights on the same batches eagerly and captured; the
// losses must be bitwise equal (issue 41). Then ms/step, the median of `--rounds` rounds.
//
//   build/bench/bench_captured_step [--preset bench] [--batch 8] [--seq 512] [--steps 20]
//
// Without a GPU (or built against a CPU LibTorch) it says why and times nothing.
// Last line: RESULT eager_plain_ms=.. eager_tp1_ms=.. captured_plain_ms=.. captured_tp1_ms=..
//   tp1_vs_plain_eager=.. tp1_vs_plain_captured=.. captured_speedup_tp1=.. losses_equal=0|1
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/cli.h"
#include "common/local_ranks.h"
#include "dtensor/dtensor.h"

namespace {

namespace models = dtensor::models;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string preset = "bench";
  int64_t batch = 8, seq = 512;
  int steps = 20, rounds = 5;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// One variant's model, optimizer and step on the static inputs.
struct Trainee {
  models::Transformer model{nullptr};
  std::unique_ptr<dtensor::optim::CapturableAdamW> opt;
  at::Tensor tokens, targets;  // static inputs: the step reads its batch here

  Trainee(const Options& o, const dtensor::DeviceMesh* tp1) {
    model = models::Transformer(models::DecoderConfig::preset(o.preset));
    model->init_weights(0);
    model->to(at::kCUDA, at::kBFloat16);
    if (tp1 != nullptr) models::apply_tensor_parallel(*model, *tp1);
    opt = std::make_unique<dtensor::optim::CapturableAdamW>(
        model->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
    tokens = at::zeros({o.batch, o.seq}, at::dtype(at::kLong).device(at::kCUDA));
    targets = at::zeros_like(tokens);
  }
  at::Tensor step() {
    opt->zero_grad();
    at::Tensor loss = models::loss_and_backward(model->forward(tokens), targets);
    dtensor::tp::reduce_partial_grads(*model);
    dtensor::nn::utils::clip_grad_norm_on_device_(model->parameters(), 1.0);
    opt->step();
    return loss;
  }
};

struct Run {
  std::vector<float> losses;  // one per step
  double ms = 0;              // median ms/step over the timed rounds
};

// `steps` training steps on `batches` (eager, or through a CapturedStep), then the timed rounds.
Run train(const Options& o, const dtensor::DeviceMesh* tp1, bool captured,
          const std::vector<at::Tensor>& batches) {
  Trainee t(o, tp1);
  std::unique_ptr<models::CapturedStep> graph;
  if (captured)
    graph = std::make_unique<models::CapturedStep>([&] { return t.step(); },
                                                   std::vector<at::Tensor>{t.tokens, t.targets});
  auto one = [&](const at::Tensor& batch) {
    const at::Tensor in = batch.slice(1, 0, -1), out = batch.slice(1, 1);
    if (graph) return graph->run({in, out});
    t.tokens.copy_(in);
    t.targets.copy_(out);
    return t.step();
  };
  const at::Tensor losses = at::empty({o.steps}, at::dtype(at::kFloat).device(at::kCUDA));
  for (int s = 0; s < o.steps; ++s) losses[s].copy_(one(batches[s]));
  Run r;
  const at::Tensor host = losses.cpu();
  r.losses.assign(host.data_ptr<float>(), host.data_ptr<float>() + o.steps);
  std::vector<double> ms;
  for (int round = 0; round < o.rounds; ++round) {
    torch::cuda::synchronize();
    const auto start = Clock::now();
    for (int s = 0; s < o.steps; ++s) (void)one(batches[s]);
    torch::cuda::synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count() / o.steps);
  }
  r.ms = median(ms);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app("", "bench_captured_step");
  app.add_option("--preset", o.preset)->check(dtensor::cli::one_of({"tiny", "demo", "bench"}));
  app.add_option("--batch", o.batch)->check(dtensor::cli::integer(1));
  app.add_option("--seq", o.seq)->check(dtensor::cli::integer(2));
  app.add_option("--steps", o.steps)->check(dtensor::cli::integer(5));
  app.add_option("--rounds", o.rounds)->check(dtensor::cli::integer(1));
  if (auto code = dtensor::cli::parse(app, argc, argv, "")) return *code;
  models::CaptureConditions conditions;
  conditions.cuda =
      at::detail::getCUDAHooks().hasCUDA() && at::detail::getCUDAHooks().deviceCount() > 0;
  // A CPU LibTorch build has no GPU either: name the build, the cause.
  if (!models::built_with_cuda_graphs()) conditions.cuda = true;
  if (auto why = models::capture_refusal(conditions)) {
    std::printf("bench_captured_step: nothing timed: %s\n", why->c_str());
    std::printf(
        "RESULT eager_plain_ms=nan eager_tp1_ms=nan captured_plain_ms=nan captured_tp1_ms=nan "
        "tp1_vs_plain_eager=nan tp1_vs_plain_captured=nan captured_speedup_tp1=nan "
        "losses_equal=nan\n");
    return 0;
  }
  try {
    at::set_num_threads(1);
    for (const auto& [key, value] : dtensor::launch::rank_env(0, 1, dtensor::launch::free_port()))
      setenv(key.c_str(), value.c_str(), 1);
    const auto mesh = dtensor::init_device_mesh("cuda", {1}, {"tp"});
    at::manual_seed(0);
    const int64_t vocab = models::DecoderConfig::preset(o.preset).vocab_size;
    std::vector<at::Tensor> batches;
    for (int s = 0; s < o.steps; ++s)
      batches.push_back(at::randint(vocab, {o.batch, o.seq + 1}, at::kLong).to(at::kCUDA));
    const Run eager_plain = train(o, nullptr, false, batches);
    const Run captured_plain = train(o, nullptr, true, batches);
    const Run eager_tp1 = train(o, &mesh, false, batches);
    const Run captured_tp1 = train(o, &mesh, true, batches);
    auto same = [&](const Run& a, const Run& b) {
      return std::memcmp(a.losses.data(), b.losses.data(), a.losses.size() * sizeof(float)) == 0;
    };
    const bool equal = same(eager_plain, captured_plain) && same(eager_tp1, captured_tp1);
    std::printf("bench_captured_step: preset %s, %lld x %lld tokens, bfloat16, %d steps\n",
                o.preset.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.seq),
                o.steps);
    std::printf("%-18s %10s %14s %14s\n", "", "ms/step", "first loss", "last loss");
    auto row = [&](const char* name, const Run& r) {
      std::printf("%-18s %10.3f %14.6f %14.6f\n", name, r.ms, r.losses.front(), r.losses.back());
    };
    row("eager plain", eager_plain);
    row("eager tp1", eager_tp1);
    row("captured plain", captured_plain);
    row("captured tp1", captured_tp1);
    std::printf("losses bitwise equal eager vs captured over %d steps: %s\n", o.steps,
                equal ? "yes" : "NO");
    std::printf(
        "RESULT eager_plain_ms=%.3f eager_tp1_ms=%.3f captured_plain_ms=%.3f "
        "captured_tp1_ms=%.3f tp1_vs_plain_eager=%.3f tp1_vs_plain_captured=%.3f "
        "captured_speedup_tp1=%.3f losses_equal=%d\n",
        eager_plain.ms, eager_tp1.ms, captured_plain.ms, captured_tp1.ms,
        eager_tp1.ms / eager_plain.ms, captured_tp1.ms / captured_plain.ms,
        eager_tp1.ms / captured_tp1.ms, equal ? 1 : 0);
    dtensor::comm::destroy_process_group();
    return equal ? 0 : 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bench_captured_step: %s\n", e.what_without_backtrace());
    return 1;
  }
}
