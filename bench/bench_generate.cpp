// Prefill and decode throughput of models::generate (KV cache, greedy) at TP=1 and TP=2 on
// local CPU ranks, one thread per rank, and of Hugging Face transformers on the same model in
// the same run (bench/hf_generate.py: the model saved with save_hf, PyTorch eager).
//
//   bench_generate [--preset bench] [--batch 1] [--prompt 128] [--new 64] [--rounds 3]
//
// Prints a table (median over rounds, after one warm-up) and last line
//   RESULT decode_tps_tp1=<new tokens/s> decode_tps_tp2=<Gloo> decode_tps_tp2_mpi=<...>
//          decode_tps_hf=<...>
//          speedup_vs_hf_tp1=<decode_tps_tp1 / decode_tps_hf> greedy_matches_hf=<0|1>
// Decode tokens/s counts every generated token of the batch over the decode steps' time. The
// rows "modules, no cache" run the training modules' forward (DTensors under TP) on the same
// model: over the prompts, and once per new token over its mean context, which is what
// generating through them (they keep no KV cache) would cost; RESULT adds
//          prefill_tps_tp1=<> modules_prefill_tps_tp1=<> modules_decode_tps_tp1=<> (and _tp2)
#include <ATen/ATen.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/cli.h"
#include "dtensor/comm/backend.h"
#include "dtensor/comm/process_group.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/generate.h"
#include "dtensor/models/hf_checkpoint.h"
#include "hf_generate.h"

namespace {

using namespace dtensor;

constexpr const char* kUsage = R"(usage: bench_generate [options]

Prefill and decode tokens/s of generate() (greedy, KV cache, one thread per rank) at TP=1 and
TP=2 on local ranks (TP=2 over Gloo and, when the build has it, over MPI), and of Hugging Face transformers on the same weights and prompts in the
same run (bench/hf_generate.py; left out when python3 cannot import transformers). Last line:
  RESULT decode_tps_tp1=... decode_tps_tp2=<Gloo> decode_tps_tp2_mpi=... decode_tps_hf=...
         speedup_vs_hf_tp1=<decode_tps_tp1 / decode_tps_hf>
         greedy_matches_hf=<1 when HF's greedy tokens of prompt 0 equal ours at TP=1>

options:
  --preset NAME    model preset with random weights (default bench; tiny, demo), or qwen3:
                   Qwen3-0.6B's layer shape (head_dim 128, q/k norms, tied) with 6 layers,
                   or qwen3-moe: those layers with Qwen3-MoE's experts (32 of width 384, top 4)
  --batch N        prompts (default 1)
  --prompt N       tokens per prompt (default 128)
  --new N          new tokens per prompt (default 64, at least 2)
  --rounds N       timed rounds after one warm-up (default 3)
  --hf-script P    default bench/hf_generate.py
  --no-hf          skip transformers
  --no-mpi         skip TP=2 on the MPI backend (its ranks started by mpirun)
  --help           print this help
)";

struct Options {
  std::string preset = "bench";
  int64_t batch = 1, prompt = 128, new_tokens = 64;
  int rounds = 3;
  std::string hf_script = "bench/hf_generate.py";
  bool hf = true;
  bool mpi = true;
  bool worker = false;  // a rank of the MPI run
};

struct Numbers {
  double prefill_tps = 0, decode_tps = 0;
  // The training modules' forward (TransformerImpl::forward, DTensors under TP, no KV cache)
  // on the same model: over the prompts, and per new token over its mean context (prompt +
  // new / 2), which is what generation through them would cost.
  double modules_prefill_tps = 0, modules_decode_tps = 0;
  std::string tokens;  // prompt 0's new tokens, comma-separated
};

// Qwen3-0.6B's layer (width 1024, 16 heads of 128 = twice 1024 / 16, 8 KV heads, FFN 3072,
// q/k norms, tied embeddings, rope base 1e6) with 6 layers and a 32k vocabulary, so that
// the four runs take minutes on one core each. save_hf writes it as Qwen3ForCausalLM.
models::DecoderConfig qwen3_shaped() {
  models::DecoderConfig c;
  c.dim = 1024;
  c.n_layers = 6;
  c.n_heads = 16;
  c.n_kv_heads = 8;
  c.head_size = 128;
  c.ffn_hidden_dim = 3072;
  c.vocab_size = 32000;
  c.qk_norm = true;
  c.tie_embeddings = true;
  c.rope_theta = 1e6;
  c.norm_eps = 1e-6;
  c.max_seq_len = 4096;
  return c;
}

// qwen3_shaped with Qwen3-MoE's sparse feed-forward in every layer, scaled down as the layers
// are: 32 experts of width 384 (Qwen3-30B-A3B: 128 of 768 at twice the width), top 4 of them
// renormalised. save_hf writes it as Qwen3MoeForCausalLM.
models::DecoderConfig qwen3_moe_shaped() {
  models::DecoderConfig c = qwen3_shaped();
  models::DecoderMoe moe;
  moe.options.num_experts = 32;
  moe.options.top_k = 4;
  moe.options.renormalize = true;
  moe.expert_hidden_dim = 384;
  c.moe = moe;
  return c;
}

// The same model on every rank and in the HF copy: the preset, parameters from seed 0.
models::Transformer make_model(const Options& o) {
  if (o.preset == "qwen3") return models::Transformer(qwen3_shaped());
  if (o.preset == "qwen3-moe") return models::Transformer(qwen3_moe_shaped());
  return models::Transformer(models::DecoderConfig::preset(o.preset));
}

// The prompts: seed 1, uniform token ids.
std::vector<std::vector<int64_t>> make_prompts(const Options& o, int64_t vocab) {
  at::manual_seed(1);
  const at::Tensor ids = at::randint(vocab, {o.batch, o.prompt}, at::kLong);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t b = 0; b < o.batch; ++b) {
    auto row = ids[b].contiguous();
    prompts.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + o.prompt);
  }
  return prompts;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// This process's rank (from the launcher's environment) measures; rank 0 writes
// "prefill_tps decode_tps modules_prefill_tps modules_decode_tps tokens" to `fd`.
int measure(const Options& o, int fd) {
  at::set_num_threads(1);
  comm::init_process_group();
  const int rank = comm::get_rank();
  auto mesh = init_device_mesh("cpu", {comm::get_world_size()}, {"tp"});
  models::Transformer model = make_model(o);
  models::TensorParallelOptions tp;
  tp.sequence_parallel = false;
  models::apply_tensor_parallel(*model, mesh, tp);
  model->init_weights(0);
  const auto prompts = make_prompts(o, model->config().vocab_size);
  models::GenerateOptions g;
  g.max_new_tokens = o.new_tokens;
  std::vector<double> prefill, decode;
  std::string tokens;
  for (int r = 0; r <= o.rounds; ++r) {
    const auto res = models::generate(*model, prompts, g);
    if (r == 0) continue;  // warm-up
    prefill.push_back(static_cast<double>(res.prompt_tokens) / res.prefill_seconds);
    // The first new token comes from the prefill; the others from decode steps.
    decode.push_back(static_cast<double>(res.decode_steps * o.batch) / res.decode_seconds);
    tokens.clear();
    for (int64_t t : res.tokens.at(0)) tokens += (tokens.empty() ? "" : ",") + std::to_string(t);
  }
  // The same model through the training modules, forward only.
  std::vector<double> modules_prefill, modules_decode;
  {
    at::NoGradGuard no_grad;
    model->eval();
    at::manual_seed(2);
    const int64_t vocab = model->config().vocab_size;
    const at::Tensor ids = at::randint(vocab, {o.batch, o.prompt}, at::kLong);
    const at::Tensor context =
        at::randint(vocab, {o.batch, o.prompt + o.new_tokens / 2}, at::kLong);
    for (int r = 0; r <= o.rounds; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor logits = model->forward(ids);
      const auto t1 = std::chrono::steady_clock::now();
      logits = model->forward(context);
      const auto t2 = std::chrono::steady_clock::now();
      if (r == 0) continue;  // warm-up
      modules_prefill.push_back(static_cast<double>(ids.numel()) /
                                std::chrono::duration<double>(t1 - t0).count());
      modules_decode.push_back(static_cast<double>(o.batch) /
                               std::chrono::duration<double>(t2 - t1).count());
    }
  }
  if (rank == 0) {
    const std::string line = std::to_string(median(prefill)) + " " +
                             std::to_string(median(decode)) + " " +
                             std::to_string(median(modules_prefill)) + " " +
                             std::to_string(median(modules_decode)) + " " + tokens + "\n";
    if (::write(fd, line.data(), line.size()) < 0) return 1;
  }
  comm::destroy_process_group();
  return 0;
}

// One forked rank of a TP=`world` run over Gloo.
int run_rank(const Options& o, int rank, int world, int port, int fd) {
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("DTENSOR_BACKEND", "gloo", 1);
  return measure(o, fd);
}

// "prefill_tps decode_tps modules_prefill_tps modules_decode_tps tokens" as rank 0 wrote it.
Numbers parse_numbers(const std::string& reply, const std::string& what) {
  Numbers x;
  std::istringstream in(reply);
  if (!(in >> x.prefill_tps >> x.decode_tps >> x.modules_prefill_tps >> x.modules_decode_tps >>
        x.tokens))
    throw std::runtime_error(what + " sent no numbers");
  return x;
}

Numbers run_tp(const Options& o, int world, int port) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      int code = 1;
      try {
        code = run_rank(o, r, world, port, fds[1]);
      } catch (const std::exception& e) {
        std::cerr << "bench_generate: rank " << r << " of TP=" << world << ": " << e.what() << "\n";
      }
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  ::close(fds[1]);
  std::string reply;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) reply.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  bool ok = !reply.empty();
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) throw std::runtime_error("TP=" + std::to_string(world) + " run failed");
  return parse_numbers(reply, "TP=" + std::to_string(world));
}

// TP=2 with the MPI backend: this program again, its ranks started by mpirun; nullopt (with
// the reason on stderr) when it cannot run here.
std::optional<Numbers> run_tp2_mpi(const Options& o, int port) {
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  std::string cmd =
      std::string(MPIEXEC_PATH) + " -np 2" + (::geteuid() == 0 ? " --allow-run-as-root" : "") +
      " -x OMP_NUM_THREADS=1 -x DTENSOR_BACKEND=mpi -x MASTER_ADDR=127.0.0.1" +
      " -x MASTER_PORT=" + std::to_string(port) + " " + self + " --worker" + " --preset " +
      o.preset + " --batch " + std::to_string(o.batch) + " --prompt " + std::to_string(o.prompt) +
      " --new " + std::to_string(o.new_tokens) + " --rounds " + std::to_string(o.rounds);
  const auto r = dtensor::bench::run_command(cmd);
  if (!r || r->status != 0 || r->out.empty()) {
    std::cerr << "bench_generate: TP=2 on MPI left out: the mpirun job failed\n"
              << (r ? r->out : std::string());
    return std::nullopt;
  }
  return parse_numbers(r->out, "TP=2 on MPI");
}

// Transformers on the same weights and prompts; nullopt (with the reason on stderr) when it
// cannot run here.
std::optional<Numbers> run_hf(const Options& o) {
  models::Transformer model = make_model(o);
  model->init_weights(0);
  std::string why;
  const auto f = dtensor::bench::hf_generate(*model, make_prompts(o, model->config().vocab_size),
                                             "OMP_NUM_THREADS=1 python3", o.hf_script, o.new_tokens,
                                             "--rounds " + std::to_string(o.rounds), &why);
  if (!f) {
    std::cerr << "bench_generate: transformers left out: " << why << "\n";
    return std::nullopt;
  }
  Numbers x;
  if (f->count("prefill_tps")) x.prefill_tps = std::stod(f->at("prefill_tps"));
  if (f->count("decode_tps")) x.decode_tps = std::stod(f->at("decode_tps"));
  if (f->count("tokens")) x.tokens = f->at("tokens");
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  namespace cli = dtensor::cli;
  Options o;
  CLI::App app("", "bench_generate");
  app.add_option("--preset", o.preset)
      ->check(cli::one_of({"tiny", "demo", "bench", "qwen3", "qwen3-moe"}));
  app.add_option("--batch", o.batch)->check(cli::integer(1));
  app.add_option("--prompt", o.prompt)->check(cli::integer(1));
  app.add_option("--new", o.new_tokens)->check(cli::integer(2));
  app.add_option("--rounds", o.rounds)->check(cli::integer(1, 1 << 20));
  app.add_option("--hf-script", o.hf_script)->check(cli::non_empty());
  app.add_flag_callback("--no-hf", [&] { o.hf = false; })->disable_flag_override();
  app.add_flag_callback("--no-mpi", [&] { o.mpi = false; })->disable_flag_override();
  app.add_flag("--worker", o.worker)->disable_flag_override();
  if (auto code = cli::parse(app, argc, argv, kUsage)) return *code;
  try {
    if (o.worker) return measure(o, STDOUT_FILENO);
    const int port = 29500 + static_cast<int>(::getpid() % 2000);
    const Numbers tp1 = run_tp(o, 1, port), tp2 = run_tp(o, 2, port + 1);
    const std::optional<Numbers> tp2_mpi =
        o.mpi && comm::has_mpi() ? run_tp2_mpi(o, port + 2) : std::nullopt;
    const std::optional<Numbers> hf = o.hf ? run_hf(o) : std::nullopt;
    std::printf(
        "generate: preset %s, batch %lld, prompt %lld, %lld new tokens, greedy, median "
        "of %d rounds, 1 thread per rank\n",
        o.preset.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.prompt),
        static_cast<long long>(o.new_tokens), o.rounds);
    std::printf("%-26s %18s %18s\n", "run", "prefill tokens/s", "decode tokens/s");
    std::printf("%-26s %18.1f %18.1f\n", "dtensor TP=1", tp1.prefill_tps, tp1.decode_tps);
    std::printf("%-26s %18.1f %18.1f\n", "dtensor TP=2 Gloo", tp2.prefill_tps, tp2.decode_tps);
    std::printf("%-26s %18.1f %18.1f\n", "  modules, no cache, TP=1", tp1.modules_prefill_tps,
                tp1.modules_decode_tps);
    std::printf("%-26s %18.1f %18.1f\n", "  modules, no cache, TP=2", tp2.modules_prefill_tps,
                tp2.modules_decode_tps);
    if (tp2_mpi) {
      std::printf("%-26s %18.1f %18.1f\n", "dtensor TP=2 MPI", tp2_mpi->prefill_tps,
                  tp2_mpi->decode_tps);
    } else {
      std::printf("%-26s %18s %18s\n", "dtensor TP=2 MPI", "-", "(not run)");
    }
    if (hf) {
      std::printf("%-26s %18.1f %18.1f\n", "HF transformers (1 rank)", hf->prefill_tps,
                  hf->decode_tps);
    } else {
      std::printf("%-26s %18s %18s\n", "HF transformers (1 rank)", "-", "(not run)");
    }
    const bool tp_same = tp1.tokens == tp2.tokens && (!tp2_mpi || tp2_mpi->tokens == tp1.tokens);
    std::printf("greedy tokens of prompt 0: TP=2 %s TP=1", tp_same ? "==" : "!=");
    if (hf) std::printf(", HF %s TP=1", hf->tokens == tp1.tokens ? "==" : "!=");
    std::printf("\n");
    // The Decoder (local shards, KV cache) against the training modules' forward.
    char modules_buf[256];
    std::snprintf(modules_buf, sizeof modules_buf,
                  "prefill_tps_tp1=%.1f modules_prefill_tps_tp1=%.1f modules_decode_tps_tp1=%.1f "
                  "prefill_tps_tp2=%.1f modules_prefill_tps_tp2=%.1f modules_decode_tps_tp2=%.1f",
                  tp1.prefill_tps, tp1.modules_prefill_tps, tp1.modules_decode_tps, tp2.prefill_tps,
                  tp2.modules_prefill_tps, tp2.modules_decode_tps);
    const std::string modules = modules_buf;
    if (hf) {
      std::printf(
          "RESULT decode_tps_tp1=%.1f decode_tps_tp2=%.1f decode_tps_tp2_mpi=%.1f "
          "decode_tps_hf=%.1f speedup_vs_hf_tp1=%.3f greedy_matches_hf=%d %s\n",
          tp1.decode_tps, tp2.decode_tps, tp2_mpi ? tp2_mpi->decode_tps : std::nan(""),
          hf->decode_tps, tp1.decode_tps / hf->decode_tps, hf->tokens == tp1.tokens ? 1 : 0,
          modules.c_str());
    } else {
      std::printf(
          "RESULT decode_tps_tp1=%.1f decode_tps_tp2=%.1f decode_tps_tp2_mpi=%.1f "
          "decode_tps_hf=nan speedup_vs_hf_tp1=nan greedy_matches_hf=nan %s\n",
          tp1.decode_tps, tp2.decode_tps, tp2_mpi ? tp2_mpi->decode_tps : std::nan(""),
          modules.c_str());
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_generate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
