// bench_pipeline: pipeline parallelism on 2 CPU ranks (one thread each) for one model: step
// time and measured bubble of GPipe, 1F1B and interleaved 1F1B (v = 2 stages per rank) at pp=2
// with M = 1, 2, 4, 8 micro-batches next to the schedules' formula (pp-1)/(vM+pp-1), and the
// step time of (pp=2, tp=1) against
// (pp=1, tp=2) on the same model and batch.
//
//   build/bench/bench_pipeline [--preset demo] [--batch 8] [--seq 128] [--steps 5]
//   build/bench/bench_pipeline --layouts    # 8 ranks: (pp, dp, tp) layouts side by side
//
// --layouts runs on 8 ranks instead: one training step (forward, backward, gradient clipping,
// AdamW) of the same model and batch at (pp, dp, tp) = (1, 1, 8), (1, 8, 1), (1, 2, 4), (2, 1, 4)
// and (2, 2, 2) with 1F1B and interleaved 1F1B (v = 2), M = 4, each composed by
// models::parallelize / parallelize_pipeline (FSDP wherever dp > 1), reported as ratios to
// (1, 1, 8). On a machine with fewer cores than 8 the ranks share them: the ratios then compare
// the layouts' total work and messages, not what 8 devices would give. Its last line is
//   RESULT layout_ms_1_1_8=<> ... ratio_2_2_2_interleaved=<>
//
// Alone it starts itself on 2 local ranks (loopback); under a launcher (RANK set) it runs as
// those ranks. A step is the schedule's forward and backward over the batch and AdamW's step;
// its time is the slowest rank's, the median over --steps after one warm-up step. The measured
// bubble is, per stage, the share of the schedule's step not spent computing (waiting on
// receives, on sends, on the tied-gradient swap), averaged over the two stages (the mean, not
// the max; the max is printed too). The last line is machine-readable:
//   RESULT bubble_gpipe_m1=<> ... bubble_interleaved_m8=<> formula_m1=<> ...
//          formula_interleaved_m1=<> ... step_ms_gpipe_m1=<> ...
//          pp2_ms=<1F1B, M=4> tp2_ms=<> pp2_vs_tp2=<pp2_ms / tp2_ms>
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/cli.h"
#include "common/local_ranks.h"
#include "dtensor/comm/backend.h"
#include "dtensor/dtensor.h"
#include "dtensor/models/parallelize.h"
#include "dtensor/models/transformer_stage.h"

namespace {

constexpr const char* kUsage = R"(usage: bench_pipeline [options]

Pipeline parallelism on 2 CPU ranks: step time and measured bubble of GPipe, 1F1B and
interleaved 1F1B (2 stages per rank) at pp=2 with M = 1, 2, 4, 8 micro-batches against
(pp-1)/(vM+pp-1), and (pp=2, tp=1) against
(pp=1, tp=2) on the same model. Alone it starts itself on 2 local ranks.
The last line is:
  RESULT bubble_gpipe_m4=<> formula_m4=<> ... pp2_ms=<> tp2_ms=<> pp2_vs_tp2=<>

options:
  --preset NAME   tiny | demo | bench (default demo)
  --batch N       sequences per step, divisible by 8 (default 8)
  --seq N         sequence length (default 128)
  --steps N       timed steps per configuration, after one warm-up step (default 5)
  --layouts       on 8 ranks: (pp, dp, tp) = (1,1,8), (1,8,1), (1,2,4), (2,1,4), (2,2,2) 1F1B
                  and interleaved (M = 4), step time and ratio to (1,1,8); RESULT layout_ms_*
  --help          print this help
)";

using Clock = std::chrono::steady_clock;
using namespace dtensor;

struct Options {
  std::string preset = "demo";
  int64_t batch = 8, seq = 128, steps = 5;
  bool layouts = false;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double all_reduce(double v, ReduceOp op) {
  return comm::all_reduce(at::scalar_tensor(v, at::kDouble), op, *comm::world_group())
      .item<double>();
}

struct Measured {
  double step_ms = 0;
  double bubble_mean = 0, bubble_max = 0;  // over the stages
};

// `step` once to warm up, then opt.steps times; the slowest rank's time per step.
template <typename Step>
std::vector<double> time_steps(const Options& opt, Step&& step) {
  step();
  std::vector<double> ms;
  for (int64_t i = 0; i < opt.steps; ++i) {
    comm::barrier();
    const auto t0 = Clock::now();
    step();
    ms.push_back(all_reduce(std::chrono::duration<double, std::milli>(Clock::now() - t0).count(),
                            ReduceOp::Max));
  }
  return ms;
}

Measured run_pipeline(const Options& opt, const models::DecoderConfig& config, const at::Tensor& x,
                      const at::Tensor& y, const std::string& kind, int64_t m) {
  auto mesh = init_device_mesh("cpu", {2, 1}, {"pp", "tp"});
  models::Transformer whole(config);
  whole->init_weights(0);
  auto stages = models::split_transformer_stages(*whole, mesh, kind == "interleaved" ? 2 : 1);
  std::vector<std::unique_ptr<pp::PipelineStage>> pipes;
  std::vector<pp::PipelineStage*> ptrs;
  std::vector<at::Tensor> params;
  for (auto& stage : stages) {
    pipes.push_back(models::make_pipeline_stage(stage, mesh));
    ptrs.push_back(pipes.back().get());
    for (const auto& p : stage->parameters()) params.push_back(p);
  }
  auto loss = [](const at::Tensor& out, const at::Tensor& target) {
    return models::token_cross_entropy(out, target);
  };
  std::unique_ptr<pp::Schedule> schedule;
  if (kind == "gpipe") {
    schedule = std::make_unique<pp::ScheduleGPipe>(*ptrs[0], m, loss);
  } else if (kind == "1f1b") {
    schedule = std::make_unique<pp::Schedule1F1B>(*ptrs[0], m, loss);
  } else {
    schedule = std::make_unique<pp::ScheduleInterleaved1F1B>(ptrs, m, loss);
  }
  torch::optim::AdamW adam(params, torch::optim::AdamWOptions(1e-4));
  std::vector<double> idle;
  const auto ms = time_steps(opt, [&] {
    adam.zero_grad();
    schedule->step(x, y);
    adam.step();
    const auto& t = schedule->last_timing();
    idle.push_back(1 - t.compute_s / t.total_s);
  });
  idle.erase(idle.begin());  // the warm-up step
  Measured r;
  r.step_ms = median(ms);
  const double mine = median(idle);
  r.bubble_mean = all_reduce(mine, ReduceOp::Sum) / 2;
  r.bubble_max = all_reduce(mine, ReduceOp::Max);
  return r;
}

double run_tp2(const Options& opt, const models::DecoderConfig& config, const at::Tensor& x,
               const at::Tensor& y) {
  auto mesh = init_device_mesh("cpu", {2}, {"tp"});
  models::Transformer model(config);
  model->init_weights(0);
  models::TensorParallelOptions tp;
  tp.sequence_parallel = true;
  tp.loss_parallel = true;
  models::apply_tensor_parallel(*model, mesh, tp);
  torch::optim::AdamW adam(model->parameters(), torch::optim::AdamWOptions(1e-4));
  return median(time_steps(opt, [&] {
    adam.zero_grad();
    models::loss_and_backward(model->forward(x), y);
    models::reduce_partial_grads(*model);
    adam.step();
  }));
}

// One layout of --layouts: (pp, dp, tp), the schedule under pp.
struct Layout {
  int64_t pp, dp, tp;
  std::string schedule;  // empty without pp
  std::string key() const {
    return std::to_string(pp) + "_" + std::to_string(dp) + "_" + std::to_string(tp) +
           (schedule.empty() ? "" : "_" + schedule);
  }
};

// The median step time of `layout` on the 8 ranks: forward and backward of the global batch
// (each dp rank its rows), the gradients clipped by their global norm, AdamW.
double run_layout(const Options& opt, const models::DecoderConfig& config, const at::Tensor& x,
                  const at::Tensor& y, const Layout& l) {
  models::ParallelizeOptions par;
  par.fully_shard = l.dp > 1;
  const int64_t rows = opt.batch / l.dp;
  if (l.pp == 1) {
    auto mesh = init_device_mesh("cpu", {l.dp, l.tp}, {"dp", "tp"});
    const int64_t first = mesh.get_local_rank("dp") * rows;
    models::Transformer model(config);
    model->init_weights(0);
    models::parallelize(*model, mesh, par);
    torch::optim::AdamW adam(model->parameters(), torch::optim::AdamWOptions(1e-4));
    return median(time_steps(opt, [&] {
      adam.zero_grad();
      models::loss_and_backward(model->forward(x.narrow(0, first, rows)), y.narrow(0, first, rows));
      models::reduce_partial_grads(*model);
      dtensor::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
      adam.step();
    }));
  }
  auto mesh = init_device_mesh("cpu", {l.pp, l.dp, l.tp}, {"pp", "dp", "tp"});
  const int64_t first = mesh.get_local_rank("dp") * rows;
  models::Transformer whole = models::meta_transformer(config);
  models::TransformerPipeline p =
      models::parallelize_pipeline(*whole, mesh, par,
                                   {.schedule = l.schedule,
                                    .virtual_stages = l.schedule == "interleaved" ? 2 : 1,
                                    .microbatches = 4},
                                   [](models::TransformerImpl& w) { w.init_weights(0); });
  const auto params = p.parameters();
  const auto clip = p.clip_options();
  torch::optim::AdamW adam(params, torch::optim::AdamWOptions(1e-4));
  return median(time_steps(opt, [&] {
    adam.zero_grad();
    p.schedule->step(x.narrow(0, first, rows), y.narrow(0, first, rows));
    for (auto& st : p.stages) models::reduce_partial_grads(*st);
    dtensor::nn::utils::clip_grad_norm_(params, 1.0, clip);
    adam.step();
  }));
}

int run_layouts(const Options& opt, const models::DecoderConfig& config, const at::Tensor& x,
                const at::Tensor& y) {
  const bool rank0 = comm::get_rank() == 0;
  const std::vector<Layout> layouts{{1, 1, 8, ""},     {1, 8, 1, ""},     {1, 2, 4, ""},
                                    {2, 1, 4, "1f1b"}, {2, 2, 2, "1f1b"}, {2, 2, 2, "interleaved"}};
  if (rank0) {
    std::printf("%-24s %10s %14s\n", "(pp, dp, tp) schedule", "step ms", "vs (1, 1, 8)");
  }
  std::string result;
  char buf[160];
  double base = 0;
  for (const Layout& l : layouts) {
    const double ms = run_layout(opt, config, x, y, l);
    if (base == 0) base = ms;
    if (!rank0) continue;
    const std::string name = "(" + std::to_string(l.pp) + ", " + std::to_string(l.dp) + ", " +
                             std::to_string(l.tp) + ") " +
                             (l.schedule.empty() ? (l.dp > 1 ? "FSDP" : "TP") : l.schedule);
    std::printf("%-24s %10.1f %13.2fx\n", name.c_str(), ms, ms / base);
    std::fflush(stdout);
    std::snprintf(buf, sizeof buf, "layout_ms_%s=%.2f ratio_%s=%.3f ", l.key().c_str(), ms,
                  l.key().c_str(), ms / base);
    result += buf;
  }
  if (rank0) std::printf("RESULT %s\n", result.c_str());
  return 0;
}

// Starts this program on `n` local ranks and returns the first failing exit code (or 0).
int launch_ranks(char** argv, int n) {
  namespace launch = dtensor::launch;
  const int port = launch::free_port();
  std::vector<std::string> args{"/proc/self/exe"};
  for (char** a = argv + 1; *a; ++a) args.emplace_back(*a);
  launch::Children children;
  children.forward_termination_signals();
  for (int rank = 0; rank < n; ++rank) {
    launch::ChildSetup setup;
    setup.env = launch::rank_env(rank, n, port);
    setup.env.push_back({"OMP_NUM_THREADS", "1"});
    setup.die_with_parent = true;
    children.add(launch::spawn_program(args, setup).pid);
  }
  launch::Children::WaitOptions wait;
  wait.stop_signal = SIGTERM;
  wait.grace = std::chrono::milliseconds(2000);
  for (const auto& o : children.wait_all(wait)) {
    if (launch::exit_code_of(o.status) != 0) return launch::exit_code_of(o.status);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app("", "bench_pipeline");
  app.add_option("--preset", opt.preset)->check(cli::one_of({"tiny", "demo", "bench"}));
  app.add_option("--batch", opt.batch)->check(cli::integer(8));
  app.add_option("--seq", opt.seq)->check(cli::integer(1));
  app.add_option("--steps", opt.steps)->check(cli::integer(1));
  app.add_flag("--layouts", opt.layouts);
  const bool worker = std::getenv("RANK") != nullptr;
  if (auto code = cli::parse(app, argc, argv, kUsage, /*quiet=*/worker)) return *code;
  if (opt.batch % 8 != 0) {
    std::fprintf(stderr, "bench_pipeline: --batch %lld must be divisible by 8 (M up to 8)\n",
                 static_cast<long long>(opt.batch));
    return 2;
  }
  const int world = opt.layouts ? 8 : 2;
  if (!worker) return launch_ranks(argv, world);

  comm::init_process_group();
  at::set_num_threads(1);
  const bool rank0 = comm::get_rank() == 0;
  TORCH_CHECK(comm::get_world_size() == world, "bench_pipeline runs on ", world,
              " ranks here, got ", comm::get_world_size());
  auto config = models::DecoderConfig::preset(opt.preset);
  config.max_seq_len = opt.seq;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor tokens =
      at::randint(config.vocab_size, {opt.batch, opt.seq + 1}, gen, at::kLong);
  const at::Tensor x = tokens.narrow(1, 0, opt.seq).contiguous();
  const at::Tensor y = tokens.narrow(1, 1, opt.seq).contiguous();

  if (rank0) {
    std::printf(
        "bench_pipeline: preset %s (%lld layers, dim %lld, %.2fM parameters), batch %lld x "
        "%lld tokens, %d CPU ranks x 1 thread on %ld cores, %s, median of %lld steps\n\n",
        opt.preset.c_str(), static_cast<long long>(config.n_layers),
        static_cast<long long>(config.dim), static_cast<double>(config.num_parameters()) / 1e6,
        static_cast<long long>(opt.batch), static_cast<long long>(opt.seq), world,
        sysconf(_SC_NPROCESSORS_ONLN), comm::cpu_backend_name().c_str(),
        static_cast<long long>(opt.steps));
  }
  if (opt.layouts) return run_layouts(opt, config, x, y);
  if (rank0) {
    std::printf("%-12s %4s %10s %14s %13s %9s\n", "schedule", "M", "step ms", "bubble (mean)",
                "bubble (max)", "formula");
  }
  std::string result;
  char buf[256];
  double pp2_ms = 0;
  for (const std::string name : {"gpipe", "1f1b", "interleaved"}) {
    const bool gpipe = name == "gpipe", interleaved = name == "interleaved";
    for (int64_t m : {1, 2, 4, 8}) {
      const Measured r = run_pipeline(opt, config, x, y, name, m);
      const double formula = pp::bubble_fraction(2, interleaved ? 2 : 1, m);
      if (name == "1f1b" && m == 4) pp2_ms = r.step_ms;
      if (!rank0) continue;
      std::printf("%-12s %4lld %10.1f %13.1f%% %12.1f%% %8.1f%%\n", name.c_str(),
                  static_cast<long long>(m), r.step_ms, 100 * r.bubble_mean, 100 * r.bubble_max,
                  100 * formula);
      std::fflush(stdout);
      std::snprintf(buf, sizeof buf, "bubble_%s_m%lld=%.4f step_ms_%s_m%lld=%.2f ", name.c_str(),
                    static_cast<long long>(m), r.bubble_mean, name.c_str(),
                    static_cast<long long>(m), r.step_ms);
      result += buf;
      if (gpipe || interleaved) {
        std::snprintf(buf, sizeof buf, "formula%s_m%lld=%.4f ", interleaved ? "_interleaved" : "",
                      static_cast<long long>(m), formula);
        result += buf;
      }
    }
  }
  const double tp2_ms = run_tp2(opt, config, x, y);
  if (rank0) {
    std::printf(
        "\n(pp=2, tp=1) 1F1B M=4: %.1f ms/step; (pp=1, tp=2) sequence + loss parallel: "
        "%.1f ms/step; ratio %.2f\n",
        pp2_ms, tp2_ms, pp2_ms / tp2_ms);
    std::snprintf(buf, sizeof buf, "pp2_ms=%.2f tp2_ms=%.2f pp2_vs_tp2=%.3f", pp2_ms, tp2_ms,
                  pp2_ms / tp2_ms);
    std::printf("RESULT %s%s\n", result.c_str(), buf);
  }
  return 0;
}
