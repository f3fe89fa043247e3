// bench_context_parallel: attention under context parallelism on --cp CPU ranks (one thread
// each), forward and backward of one attention layer:
//   1. one long causal sequence (head-tail split): the ring and the all-gather against one rank
//      computing the whole sequence alone (LibTorch's SDPA, the same flash kernel);
//   2. packed documents of random lengths filling the same tokens: the balanced split against the
//      head-tail split, as step time (ring), attended (query, key) pairs per rank (max / mean),
//      and each rank's work: the CPU time its thread spends in a forward (all-gather), max / mean
//      over ranks. CPU time, not wall time: a rank waiting in the gather or preempted by another
//      process on a shared machine does not count, so the ratio is the work's balance. The one
//      long sequence's head-tail split, balanced exactly, is the control row.
//
//   build/bench/bench_context_parallel [--cp 2] [--seq 8192] [--heads 8] [--kv-heads 2]
//                                      [--head-dim 64] [--max-doc 2048] [--steps 5]
//
// Alone it starts itself on --cp local ranks (loopback); under a launcher (RANK set) it runs as
// those ranks. Times are medians over --steps after one warm-up, each step's time the slowest
// rank's. The last line is machine-readable:
//   RESULT cp=<> seq=<> one_rank_ms=<> ring_ms=<> all_gather_ms=<> ring_speedup=<one/ring>
//          ring_vs_all_gather=<> balanced_ms=<> head_tail_ms=<> head_tail_vs_balanced=<>
//          balanced_pairs=<max/mean> head_tail_pairs=<> balanced_rank_time=<max/mean>
//          head_tail_rank_time=<> one_sequence_rank_time=<>
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/cli.h"
#include "dtensor/dtensor.h"

namespace {

constexpr const char* kUsage = R"(usage: bench_context_parallel [options]

Attention under context parallelism on --cp CPU ranks: one long sequence (ring and all-gather
against one rank alone), then packed documents of random lengths (balanced split against
head-tail: step time, attended pairs per rank, per-rank forward time). Alone it starts itself on
--cp local ranks. The last line is:
  RESULT cp=<> seq=<> one_rank_ms=<> ring_ms=<> all_gather_ms=<> ring_speedup=<> ...

options:
  --cp N          ranks the sequence is split over (default 2)
  --seq N         tokens per sequence (default 8192)
  --heads N       query heads (default 8)
  --kv-heads N    key/value heads (default 2)
  --head-dim N    head size (default 64)
  --max-doc N     packed documents have random lengths in [1, N] (default 2048)
  --steps N       timed steps per configuration after one warm-up (default 5)
  --help          print this help
)";

using Clock = std::chrono::steady_clock;
using namespace dtensor;

struct Options {
  int64_t cp = 2, seq = 8192, heads = 8, kv_heads = 2, head_dim = 64, max_doc = 2048, steps = 5;
};

// CPU time of the calling thread (the rank's compute; its collectives wait in other threads).
double thread_cpu_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Every rank's value of x, max and mean.
std::pair<double, double> over_ranks(double x, comm::ProcessGroup& pg) {
  const at::Tensor t = at::full({1}, x, at::kDouble);
  const double max = comm::all_reduce(t, ReduceOp::Max, pg).item<double>();
  const double mean = comm::all_reduce(t, ReduceOp::Avg, pg).item<double>();
  return {max, mean};
}

struct Inputs {
  at::Tensor q, k, v;  // whole (1, S, H, D), alike on every rank
};

// Median over steps of the slowest rank's forward + backward of `step`.
template <typename F>
double time_steps(const Options& opt, comm::ProcessGroup& pg, F&& step) {
  std::vector<double> times;
  for (int64_t i = 0; i <= opt.steps; ++i) {
    comm::all_reduce(at::zeros({1}), ReduceOp::Sum, pg);  // start together
    const auto t0 = Clock::now();
    step();
    const double t = over_ranks(ms_since(t0), pg).first;
    if (i > 0) times.push_back(t);
  }
  return median(times);
}

// Forward and backward of context attention over `layout`.
double cp_step_ms(const Options& opt, const Inputs& in, const cp::ContextLayout& layout,
                  const std::shared_ptr<comm::ProcessGroup>& pg, cp::RotateMethod rotate) {
  const int64_t r = pg->rank();
  return time_steps(opt, *pg, [&] {
    at::Tensor q = layout.shard(in.q, r).requires_grad_(),
               k = layout.shard(in.k, r).requires_grad_(),
               v = layout.shard(in.v, r).requires_grad_();
    cp::context_attention(q, k, v, layout, pg, {.rotate = rotate}).sum().backward();
  });
}

// Each rank's forward CPU time (all-gather), as max / mean over ranks, median over steps.
double rank_time_imbalance(const Options& opt, const Inputs& in, const cp::ContextLayout& layout,
                           const std::shared_ptr<comm::ProcessGroup>& pg) {
  const int64_t r = pg->rank();
  const at::Tensor q = layout.shard(in.q, r), k = layout.shard(in.k, r), v = layout.shard(in.v, r);
  std::vector<double> ratios;
  for (int64_t i = 0; i <= opt.steps; ++i) {
    const double t0 = thread_cpu_ms();
    at::NoGradGuard no_grad;
    cp::context_attention(q, k, v, layout, pg, {.rotate = cp::RotateMethod::all_gather});
    const auto [max, mean] = over_ranks(thread_cpu_ms() - t0, *pg);
    if (i > 0) ratios.push_back(max / mean);
  }
  return median(ratios);
}

std::vector<std::vector<int64_t>> random_lengths(int64_t seq, int64_t max_doc) {
  std::mt19937 gen(11);
  std::uniform_int_distribution<int64_t> len(1, max_doc);
  std::vector<int64_t> row;
  for (int64_t left = seq; left > 0;) {
    const int64_t l = std::min(left, len(gen));
    row.push_back(l);
    left -= l;
  }
  return {row};
}

int run(const Options& opt) {
  comm::init_process_group();
  at::set_num_threads(1);
  const DeviceMesh mesh = init_device_mesh("cpu", {opt.cp}, {"cp"});
  const auto pg = mesh.get_group(0);
  const bool rank0 = pg->rank() == 0;
  at::manual_seed(0);
  const auto f32 = at::TensorOptions(at::kFloat);
  const Inputs in{at::randn({1, opt.seq, opt.heads, opt.head_dim}, f32),
                  at::randn({1, opt.seq, opt.kv_heads, opt.head_dim}, f32),
                  at::randn({1, opt.seq, opt.kv_heads, opt.head_dim}, f32)};

  // 1. One long sequence.
  const double one_rank_ms = time_steps(opt, *pg, [&] {
    const int64_t rep = opt.heads / opt.kv_heads;
    at::Tensor q = in.q.transpose(1, 2).clone().requires_grad_();
    at::Tensor k = in.k.repeat_interleave(rep, 2).transpose(1, 2).clone().requires_grad_();
    at::Tensor v = in.v.repeat_interleave(rep, 2).transpose(1, 2).clone().requires_grad_();
    at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true).sum().backward();
  });
  const auto head_tail = cp::head_tail_layout(1, opt.seq, opt.cp);
  const double ring_ms = cp_step_ms(opt, in, head_tail, pg, cp::RotateMethod::ring);
  const double all_gather_ms = cp_step_ms(opt, in, head_tail, pg, cp::RotateMethod::all_gather);
  const double one_sequence_time = rank_time_imbalance(opt, in, head_tail, pg);

  // 2. Packed documents.
  const at::Tensor ids =
      cp::document_ids_from_lengths(random_lengths(opt.seq, opt.max_doc), opt.seq);
  const auto balanced = cp::balanced_layout(ids, opt.cp);
  const auto packed_head_tail = cp::head_tail_layout(1, opt.seq, opt.cp, ids);
  const double balanced_ms = cp_step_ms(opt, in, balanced, pg, cp::RotateMethod::ring);
  const double head_tail_ms = cp_step_ms(opt, in, packed_head_tail, pg, cp::RotateMethod::ring);
  const double balanced_time = rank_time_imbalance(opt, in, balanced, pg);
  const double head_tail_time = rank_time_imbalance(opt, in, packed_head_tail, pg);

  if (rank0) {
    std::printf(
        "attention forward + backward, float32, 1 x %lld tokens, %lld heads (%lld KV), "
        "head_dim %lld, cp = %lld\n\n",
        static_cast<long long>(opt.seq), static_cast<long long>(opt.heads),
        static_cast<long long>(opt.kv_heads), static_cast<long long>(opt.head_dim),
        static_cast<long long>(opt.cp));
    std::printf("%-44s %10s %12s\n", "one long sequence", "step ms", "work max/mean");
    std::printf("%-44s %10.1f\n", "one rank, whole sequence (SDPA)", one_rank_ms);
    std::printf("%-44s %10.1f %12.4f\n", "cp, head-tail split, ring", ring_ms, one_sequence_time);
    std::printf("%-44s %10.1f\n\n", "cp, head-tail split, all-gather", all_gather_ms);
    std::printf("packed documents (%lld, lengths 1..%lld)     %10s %12s %12s\n",
                static_cast<long long>(ids.max().item<int64_t>() + 1),
                static_cast<long long>(opt.max_doc), "step ms", "pairs max/mean", "work max/mean");
    std::printf("%-44s %10.1f %12.4f %12.4f\n", "balanced split, ring", balanced_ms,
                balanced.imbalance(), balanced_time);
    std::printf("%-44s %10.1f %12.4f %12.4f\n\n", "head-tail split, ring", head_tail_ms,
                packed_head_tail.imbalance(), head_tail_time);
    std::printf(
        "RESULT cp=%lld seq=%lld one_rank_ms=%.2f ring_ms=%.2f all_gather_ms=%.2f "
        "ring_speedup=%.3f ring_vs_all_gather=%.3f balanced_ms=%.2f head_tail_ms=%.2f "
        "head_tail_vs_balanced=%.3f balanced_pairs=%.4f head_tail_pairs=%.4f "
        "balanced_rank_time=%.4f head_tail_rank_time=%.4f one_sequence_rank_time=%.4f\n",
        static_cast<long long>(opt.cp), static_cast<long long>(opt.seq), one_rank_ms, ring_ms,
        all_gather_ms, one_rank_ms / ring_ms, ring_ms / all_gather_ms, balanced_ms, head_tail_ms,
        head_tail_ms / balanced_ms, balanced.imbalance(), packed_head_tail.imbalance(),
        balanced_time, head_tail_time, one_sequence_time);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app("", "bench_context_parallel");
  app.add_option("--cp", opt.cp)->check(cli::integer(1));
  app.add_option("--seq", opt.seq)->check(cli::integer(1));
  app.add_option("--heads", opt.heads)->check(cli::integer(1));
  app.add_option("--kv-heads", opt.kv_heads)->check(cli::integer(1));
  app.add_option("--head-dim", opt.head_dim)->check(cli::integer(1));
  app.add_option("--max-doc", opt.max_doc)->check(cli::integer(1));
  app.add_option("--steps", opt.steps)->check(cli::integer(1));
  const bool worker = std::getenv("RANK") != nullptr;
  if (auto code = cli::parse(app, argc, argv, kUsage, /*quiet=*/worker)) return *code;
  if (opt.heads % opt.kv_heads != 0) {
    std::fprintf(stderr,
                 "bench_context_parallel: --heads %lld is not a multiple of --kv-heads %lld\n",
                 static_cast<long long>(opt.heads), static_cast<long long>(opt.kv_heads));
    return 2;
  }
  if (!worker) {
    ::setenv("OMP_NUM_THREADS", "1", 1);
    return dtensor::bench::run_local_ranks("bench_context_parallel", argc, argv,
                                           static_cast<int>(opt.cp));
  }
  try {
    return run(opt);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bench_context_parallel: %s\n", e.what_without_backtrace());
    return 1;
  }
}
