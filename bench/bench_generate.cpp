// Prefill and decode throughput of models::generate (KV cache, greedy) at TP=1 and TP=2 on
// local CPU ranks, one thread per rank.
//
//   bench_generate [--preset bench] [--batch 1] [--prompt 128] [--new 64] [--rounds 3]
//
// Prints a table (median over rounds, after one warm-up) and last line
//   RESULT decode_tps_tp1=<new tokens/s> decode_tps_tp2=<new tokens/s>
// Decode tokens/s counts every generated token of the batch over the decode steps' time.
#include <ATen/ATen.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/comm/process_group.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/generate.h"

namespace {

using namespace dtensor;

struct Options {
  std::string preset = "bench";
  int64_t batch = 1, prompt = 128, new_tokens = 64;
  int rounds = 3;
};

struct Numbers {
  double prefill_tps = 0, decode_tps = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One rank of a TP=`world` run; rank 0 writes "prefill_tps decode_tps" to `fd`.
int run_rank(const Options& o, int rank, int world, int port, int fd) {
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  at::set_num_threads(1);
  comm::init_process_group();
  auto mesh = init_device_mesh("cpu", {world}, {"tp"});
  models::Transformer model(models::LlamaConfig::preset(o.preset));
  models::TensorParallelOptions tp;
  tp.sequence_parallel = false;
  models::apply_tensor_parallel(*model, mesh, tp);
  model->init_weights(0);
  at::manual_seed(1);
  const at::Tensor ids = at::randint(model->config().vocab_size, {o.batch, o.prompt}, at::kLong);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t b = 0; b < o.batch; ++b) {
    auto row = ids[b].contiguous();
    prompts.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + o.prompt);
  }
  models::GenerateOptions g;
  g.max_new_tokens = o.new_tokens;
  std::vector<double> prefill, decode;
  for (int r = 0; r <= o.rounds; ++r) {
    const auto res = models::generate(*model, prompts, g);
    if (r == 0) continue;  // warm-up
    prefill.push_back(static_cast<double>(res.prompt_tokens) / res.prefill_seconds);
    // The first new token comes from the prefill; the others from decode steps.
    decode.push_back(static_cast<double>(res.decode_steps * o.batch) / res.decode_seconds);
  }
  if (rank == 0) {
    const std::string line =
        std::to_string(median(prefill)) + " " + std::to_string(median(decode)) + "\n";
    if (::write(fd, line.data(), line.size()) < 0) return 1;
  }
  comm::destroy_process_group();
  return 0;
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
  char buf[256] = {};
  const ssize_t n = ::read(fds[0], buf, sizeof(buf) - 1);
  ::close(fds[0]);
  bool ok = n > 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) throw std::runtime_error("TP=" + std::to_string(world) + " run failed");
  Numbers x;
  if (std::sscanf(buf, "%lf %lf", &x.prefill_tps, &x.decode_tps) != 2)
    throw std::runtime_error("TP=" + std::to_string(world) + " sent no numbers");
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "bench_generate: " << a << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--preset") {
      o.preset = next();
    } else if (a == "--batch") {
      o.batch = std::stoll(next());
    } else if (a == "--prompt") {
      o.prompt = std::stoll(next());
    } else if (a == "--new") {
      o.new_tokens = std::stoll(next());
    } else if (a == "--rounds") {
      o.rounds = std::stoi(next());
    } else if (a == "--help" || a == "-h") {
      std::cout << "bench_generate [--preset bench] [--batch 1] [--prompt 128] [--new 64] "
                   "[--rounds 3]\nPrefill and decode tokens/s of generate() at TP=1 and TP=2 "
                   "(greedy, KV cache, one thread per rank).\n";
      return 0;
    } else {
      std::cerr << "bench_generate: unknown option '" << a << "' (see --help)\n";
      return 2;
    }
  }
  if (o.batch < 1 || o.prompt < 1 || o.new_tokens < 2 || o.rounds < 1) {
    std::cerr << "bench_generate: --batch, --prompt, --rounds must be >= 1 and --new >= 2\n";
    return 2;
  }
  try {
    const int port = 29500 + static_cast<int>(::getpid() % 2000);
    const Numbers tp1 = run_tp(o, 1, port), tp2 = run_tp(o, 2, port + 1);
    std::printf(
        "generate: preset %s, batch %lld, prompt %lld, %lld new tokens, greedy, median "
        "of %d rounds, 1 thread per rank\n",
        o.preset.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.prompt),
        static_cast<long long>(o.new_tokens), o.rounds);
    std::printf("%-6s %18s %18s\n", "TP", "prefill tokens/s", "decode tokens/s");
    std::printf("%-6s %18.1f %18.1f\n", "1", tp1.prefill_tps, tp1.decode_tps);
    std::printf("%-6s %18.1f %18.1f\n", "2", tp2.prefill_tps, tp2.decode_tps);
    std::printf("RESULT decode_tps_tp1=%.1f decode_tps_tp2=%.1f\n", tp1.decode_tps, tp2.decode_tps);
  } catch (const std::exception& e) {
    std::cerr << "bench_generate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
