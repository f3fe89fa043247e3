// bench_train_step: one training step of the bundled "bench" preset (Llama-shaped) six ways, in one
// run on one machine:
//   (a)  plain   LibTorch, the model without apply_tensor_parallel (no DTensor anywhere)
//   (b)  tp1     dtensor-cpp TP on a 1-rank mesh (every parameter a DTensor)
//   (c)  tp2     dtensor-cpp TP on 2 ranks, Gloo on 127.0.0.1
//   (e)  fsdp2   dtensor-cpp FSDP (fully_shard) on 2 ranks (dp=2, tp=1), Gloo: each rank
//                half of the batch
//   (c') tp2     dtensor-cpp TP on 2 ranks, MPI (shared memory; ranks started by mpirun)
//   (f), (f')    (c) and (c') with overlap_comm (tp/overlap.h): collectives overlapped with
//                the matmuls, bitwise the same losses
//   (d)  py-tp2  PyTorch's own Python TP on 2 ranks, Gloo (bench/pytorch_tp_train_step.py)
//
//   build/bench/bench_train_step      scripts/bench train_step      (--help for the options)
//
// Every variant is a long-lived worker process (two for the 2-rank ones) with the same initial
// parameters and token batches, read from one safetensors file this program writes. The
// controller hands out blocks of steps in rounds, a b c f e c' f' d then the reverse, so that each
// runs first half of the time; a block's time is the slowest rank's. Ratios are medians of
// per-round ratios, which cancels the slow phases of a busy machine far better than a ratio of
// medians. The last line is:
//   RESULT tp1_overhead_pct=<(b - a) / a * 100> speedup_vs_pytorch_tp2=<(d) / (c)>
//          tp2_vs_tp1_plain=<a / the faster of c, c'> tp2_vs_tp1_plain_gloo=<a / c>
//          tp2_vs_tp1_plain_mpi=<a / c'> fsdp2_vs_tp2_gloo=<c / e>
//          overlap_speedup=<c / f> overlap_speedup_mpi=<c' / f'> busy=<--busy>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.h"
#include "common/cli.h"
#include "common/local_ranks.h"
#include "dtensor/checkpoint/remove_directory.h"
#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/dtensor.h"
#include "dtensor/models/transformer.h"

namespace {

namespace models = dtensor::models;
namespace checkpoint = dtensor::checkpoint;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage = R"(usage: bench_train_step [options]

Times a full training step (forward, loss, backward, AdamW) of the Llama model's "bench"
preset (~29M parameters) as (a) plain LibTorch, (b) dtensor TP on a 1-rank mesh, (c) dtensor
TP on 2 ranks over Gloo, (c') the same over MPI (started by mpirun, when the build has MPI)
(d) PyTorch's Python TP on 2 ranks over Gloo (the same model, plan — sequence parallel
and loss parallel — initial parameters and data) and (e) dtensor FSDP (dp=2, tp=1) on 2 ranks
over Gloo, each rank on half of the batch, (f) and (f') (c) and (c') with overlap_comm, one
intra-op thread per rank, interleaved in rounds. Prints ms/step and tokens/s per variant, the first and last losses of each
variant, and as its last line:
  RESULT tp1_overhead_pct=<(b-a)/a*100> speedup_vs_pytorch_tp2=<(d)/(c)>
         tp2_vs_tp1_plain=<a/(faster of c, c')> tp2_vs_tp1_plain_gloo=<a/c>
         tp2_vs_tp1_plain_mpi=<a/c'> fsdp2_vs_tp2_gloo=<c/e>
         overlap_speedup=<c/f> overlap_speedup_mpi=<c'/f'> busy=<--busy>

options:
  --preset NAME          model preset (default bench; tiny, demo for a quick look)
  --batch N              sequences per step (default 4)
  --seq N                tokens per sequence (default 128; a multiple of 2)
  --warmup N             untimed steps per variant first (default 2; the first step's loss
                         is the numerics check)
  --steps N              steps per variant per round (default 2)
  --rounds N             rounds (default 7)
  --lr X                 AdamW learning rate (default 1e-3)
  --seed N               parameters and tokens (default 0)
  --pytorch-script PATH  default bench/pytorch_tp_train_step.py
  --no-pytorch           skip (d)
  --no-mpi               skip (c')
  --busy N               a busy machine: N processes spinning on the CPU beside the variants
                         for the whole run (default 0)
  --busy-nice K          their nice value (default 0: the variants' own priority)
  --quick                --preset tiny --seq 32 --warmup 1 --steps 1 --rounds 2 (for those
                         not given): a smoke test
  --help                 print this help
)";

// The variants, in the order they run in a round.
enum VariantIndex {
  kPlain,
  kTp1,
  kTp2Gloo,
  kTp2GlooOverlap,
  kFsdp2Gloo,
  kTp2Mpi,
  kTp2MpiOverlap,
  kPy,
  kVariants
};

struct Options {
  std::string preset = "bench";
  int64_t batch = 4, seq = 128;
  int warmup = 2, steps = 2, rounds = 7;
  double lr = 1e-3;
  uint64_t seed = 0;
  std::string script = "bench/pytorch_tp_train_step.py";
  bool pytorch = true;
  bool mpi = true;
  int busy = 0, busy_nice = 0;  // busy loops beside the variants, and their nice value
  // Worker side.
  std::string worker;  // "", "plain", "tp", "tp-overlap" or "fsdp"
  std::string inputs;
};

[[noreturn]] void die(const std::string& msg) {
  std::cerr << "bench_train_step: " << msg << std::endl;
  std::exit(1);
}

// ---------------------------------------------------------------------------------------------
// The line protocol between the controller and a worker (the Python script speaks it too):
//   worker -> "ready ..."            once set up
//   ctrl   -> "run N"                worker -> "ok seconds=S losses=L1,L2,... [key=value ...]"
//   ctrl   -> "quit" (or EOF)

std::map<std::string, std::string> parse_fields(const std::string& line) {
  std::map<std::string, std::string> out;
  std::istringstream in(line);
  std::string word;
  while (in >> word) {
    const auto eq = word.find('=');
    if (eq != std::string::npos) out[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return out;
}

std::vector<double> parse_list(const std::string& s) {
  std::vector<double> out;
  std::istringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::strtod(item.c_str(), nullptr));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Worker: one variant (or one rank of it).

struct StepTimes {
  double forward = 0, backward = 0, optimizer = 0;  // seconds
};

class Worker {
 public:
  Worker(const Options& opt, const std::string& kind)
      : tp_(kind != "plain"), fsdp_(kind == "fsdp") {
    at::set_num_threads(1);  // one intra-op thread per rank
    checkpoint::safetensors::File file(opt.inputs);
    config_ = models::DecoderConfig::from_json(file.metadata().at("config"));
    batches_ = file.tensor("bench.tokens");
    model_ = models::Transformer(config_);
    {
      // Every rank loads the whole model; apply_tensor_parallel then keeps each rank's chunk.
      at::NoGradGuard no_grad;
      for (auto& item : model_->named_parameters()) item.value().copy_(file.tensor(item.key()));
    }
    if (tp_) {
      dtensor::comm::init_process_group();
      world_ = dtensor::comm::world_group();
      if (fsdp_) {
        // torchtitan's layout: blocks resharded after forward, the root not.
        mesh_ = dtensor::init_device_mesh("cpu", {dtensor::comm::get_world_size()}, {"dp"});
        dtensor::fsdp::FullyShardOptions block_options, root_options;
        block_options.reshard_after_forward = true;
        for (models::TransformerBlockImpl* block : model_->blocks())
          dtensor::fsdp::fully_shard(*block, *mesh_, block_options);
        dtensor::fsdp::fully_shard(*model_, *mesh_, root_options);
      } else {
        mesh_ = dtensor::init_device_mesh("cpu", {dtensor::comm::get_world_size()});
        models::TensorParallelOptions options;
        options.overlap_comm = kind == "tp-overlap";
        models::apply_tensor_parallel(*model_, *mesh_, options);
      }
    }
    for (const auto& p : model_->parameters()) dtensor_params_ += dtensor::is_dtensor(p);
    optimizer_.emplace(
        model_->parameters(),
        torch::optim::AdamWOptions(opt.lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.01));
  }

  int rank() const { return tp_ ? dtensor::comm::get_rank() : 0; }
  // Through the rendezvous store rather than a collective: a rank waiting in an MPI broadcast
  // spins on its core, which slowed every variant that ran meanwhile (the other MPI pair's most).
  int broadcast_from_rank0(int value) {
    if (!tp_ || dtensor::comm::get_world_size() == 1) return value;
    const auto& store = world_->store();
    const std::string key =
        "bench_train_step/" + world_->name() + "/command/" + std::to_string(commands_++);
    if (rank() == 0) {
      const std::string text = std::to_string(value);
      store->set(key, std::vector<uint8_t>(text.begin(), text.end()));
      return value;
    }
    store->wait({key}, std::chrono::hours(24));  // the controller may pause between rounds
    const std::vector<uint8_t> text = store->get(key);
    return std::stoi(std::string(text.begin(), text.end()));
  }
  int64_t num_parameters() const { return config_.num_parameters(); }
  int64_t dtensor_params() const { return dtensor_params_; }

  float step(StepTimes& times) {
    at::Tensor batch = batches_[step_count_++ % batches_.size(0)];
    if (fsdp_) {  // this dp rank's slice
      const int64_t rows = batch.size(0) / mesh_->size();
      batch = batch.narrow(0, mesh_->get_local_rank() * rows, rows);
    }
    const at::Tensor tokens = batch.slice(1, 0, -1), targets = batch.slice(1, 1);
    const auto t0 = Clock::now();
    optimizer_->zero_grad();
    const at::Tensor logits = model_->forward(tokens);
    const auto t1 = Clock::now();
    const at::Tensor loss = models::loss_and_backward(logits, targets);
    if (tp_ && !fsdp_) models::reduce_partial_grads(*model_);
    const auto t2 = Clock::now();
    optimizer_->step();
    float value = loss.item<float>();
    const auto t3 = Clock::now();
    if (fsdp_) {  // the whole batch's loss: the mean of the equal slices' (not timed)
      at::Tensor l = at::tensor({value}, at::kFloat);
      value = dtensor::comm::all_reduce(l, dtensor::ReduceOp::Sum, *world_).item<float>() /
              static_cast<float>(mesh_->size());
    }
    times.forward += seconds(t0, t1);
    times.backward += seconds(t1, t2);
    times.optimizer += seconds(t2, t3);
    return value;
  }

  // Runs `steps` steps; replies with the slowest rank's time.
  std::string run(int steps) {
    sync();
    StepTimes times;
    const auto before = dtensor::dispatch::cache_stats();
    std::vector<float> losses;
    const auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i) losses.push_back(step(times));
    double elapsed = seconds(t0, Clock::now());
    const auto after = dtensor::dispatch::cache_stats();
    if (tp_) {
      at::Tensor t = at::tensor({elapsed}, at::kDouble);
      elapsed = dtensor::comm::all_reduce(t, dtensor::ReduceOp::Max, *world_).item<double>();
    }
    std::ostringstream out;
    out.precision(9);
    out << "ok seconds=" << elapsed << " losses=";
    for (size_t i = 0; i < losses.size(); ++i) out << (i ? "," : "") << losses[i];
    out << " forward=" << times.forward << " backward=" << times.backward
        << " optimizer=" << times.optimizer
        << " dtensor_ops=" << (after.hits + after.misses) - (before.hits + before.misses)
        << " cache_misses=" << after.misses - before.misses;
    return out.str();
  }

 private:
  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }
  void sync() {
    if (!tp_) return;
    at::Tensor one = at::ones({1});
    dtensor::comm::all_reduce(one, dtensor::ReduceOp::Sum, *world_);
  }

  bool tp_;  // distributed: TP, or FSDP when fsdp_
  bool fsdp_;
  models::DecoderConfig config_;
  at::Tensor batches_;  // (n, B, S + 1) int64
  models::Transformer model_{nullptr};
  std::shared_ptr<dtensor::comm::ProcessGroup> world_;
  std::optional<dtensor::DeviceMesh> mesh_;
  std::optional<torch::optim::AdamW> optimizer_;
  int64_t step_count_ = 0;
  int64_t dtensor_params_ = 0;
  int64_t commands_ = 0;
};

// The next command's step count on every rank: 0 to quit. Only rank 0 reads the controller's
// commands (mpirun hands stdin to rank 0 only); it passes them on with a broadcast.
int next_command(Worker& worker) {
  int steps = 0;
  if (worker.rank() == 0) {
    std::string line;
    if (std::getline(std::cin, line)) {
      std::istringstream in(line);
      std::string cmd;
      in >> cmd;
      if (cmd != "quit" && (cmd != "run" || !(in >> steps) || steps < 1))
        die("worker: unknown command '" + line + "'");
    }
  }
  return worker.broadcast_from_rank0(steps);
}

int run_worker(const Options& opt) {
  Worker worker(opt, opt.worker);
  // Only rank 0 talks to the controller; the others follow the same commands silently.
  const bool speak = worker.rank() == 0;
  if (speak) {
    std::printf("ready params=%lld dtensor_params=%lld\n",
                static_cast<long long>(worker.num_parameters()),
                static_cast<long long>(worker.dtensor_params()));
    std::fflush(stdout);
  }
  while (const int steps = next_command(worker)) {
    const std::string reply = worker.run(steps);
    if (speak) {
      std::printf("%s\n", reply.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Controller.

// Worker processes started so far. When the controller exits, also early through die() (whose
// std::exit runs this destructor), those still running are killed and all are reaped.
dtensor::launch::Children g_children;

// A child running `argv` with `env` added; its stdin is a pipe from us, its stdout a pipe to
// us (or /dev/null when !listen); stderr is shared.
struct Child {
  pid_t pid = -1;
  FILE* in = nullptr;   // we write commands
  FILE* out = nullptr;  // we read replies
};

Child spawn(const std::vector<std::string>& argv, const dtensor::launch::Env& env, bool listen) {
  int to_child[2], from_child[2] = {-1, -1};
  if (::pipe2(to_child, O_CLOEXEC) != 0 || (listen && ::pipe2(from_child, O_CLOEXEC) != 0))
    die(std::string("pipe: ") + std::strerror(errno));
  const int devnull = listen ? -1 : ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  dtensor::launch::ChildSetup setup;
  setup.env = env;
  setup.stdin_fd = to_child[0];
  setup.stdout_fd = listen ? from_child[1] : devnull;
  setup.close_other_fds = true;  // so a worker sees EOF when the controller goes away
  std::cout.flush();
  const auto spawned = dtensor::launch::spawn_program(argv, setup);
  g_children.add(spawned.pid);
  if (spawned.exec_errno != 0) {
    std::cerr << "bench_train_step: cannot run " << argv[0] << ": "
              << std::strerror(spawned.exec_errno) << std::endl;
  }
  if (devnull >= 0) ::close(devnull);
  ::close(to_child[0]);
  Child c;
  c.pid = spawned.pid;
  c.in = ::fdopen(to_child[1], "w");
  if (listen) {
    ::close(from_child[1]);
    c.out = ::fdopen(from_child[0], "r");
  }
  return c;
}

// The next line from a child, or nullopt at EOF (the child died).
std::optional<std::string> read_line(FILE* f) {
  std::string line;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), f)) {
    line += buf;
    if (!line.empty() && line.back() == '\n') {
      line.pop_back();
      return line;
    }
  }
  if (!line.empty()) return line;
  return std::nullopt;
}

struct Block {
  double ms_per_step = 0;
  std::vector<double> losses;
  double forward_ms = 0, backward_ms = 0, optimizer_ms = 0;  // per step; -1 when not reported
  double dtensor_ops = -1, cache_misses = -1;                // per step
};

// One variant: its processes (the first one speaks) and what it reported.
struct Variant {
  std::string key, label;
  std::vector<Child> procs;
  bool alive = false;
  std::string ready;
  std::vector<double> warmup_losses;
  std::vector<Block> rounds;
  std::vector<double> all_losses;  // every step's loss, in order

  // To the first process only: it hands the command on to its peers.
  bool send(const std::string& cmd) {
    auto& p = procs.front();
    return std::fprintf(p.in, "%s\n", cmd.c_str()) >= 0 && std::fflush(p.in) == 0;
  }

  std::optional<Block> run(int steps) {
    if (!alive) return std::nullopt;
    if (!send("run " + std::to_string(steps))) return fail("could not send a command");
    auto line = read_line(procs.front().out);
    if (!line) return fail("exited during a block of steps");
    if (line->rfind("ok ", 0) != 0) return fail("replied '" + *line + "'");
    auto f = parse_fields(*line);
    Block b;
    b.ms_per_step = std::strtod(f["seconds"].c_str(), nullptr) * 1000.0 / steps;
    b.losses = parse_list(f["losses"]);
    auto per_step = [&](const char* key, double scale) {
      return f.count(key) ? std::strtod(f[key].c_str(), nullptr) * scale / steps : -1.0;
    };
    b.forward_ms = per_step("forward", 1000.0);
    b.backward_ms = per_step("backward", 1000.0);
    b.optimizer_ms = per_step("optimizer", 1000.0);
    b.dtensor_ops = per_step("dtensor_ops", 1.0);
    b.cache_misses = per_step("cache_misses", 1.0);
    all_losses.insert(all_losses.end(), b.losses.begin(), b.losses.end());
    return b;
  }

  std::optional<Block> fail(const std::string& why) {
    std::cerr << "bench_train_step: " << label << ": " << why << "; leaving it out" << std::endl;
    alive = false;
    for (auto& p : procs) {
      if (p.pid > 0) ::kill(p.pid, SIGTERM);
    }
    return std::nullopt;
  }

  void quit() {
    if (alive) send("quit");
    for (auto& p : procs) {
      if (p.in) std::fclose(p.in);
      p.in = nullptr;
    }
    for (auto& p : procs) {
      if (p.out) std::fclose(p.out);
      p.out = nullptr;
      p.pid = -1;
    }
  }
};

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The model's initial parameters (torchtitan names), the token batches and the config.
void write_inputs(const Options& opt, const models::DecoderConfig& config,
                  const std::string& path) {
  models::Transformer model(config);
  model->init_weights(opt.seed);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : model->named_parameters()) tensors[item.key()] = item.value().detach();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(opt.seed + 1);
  constexpr int64_t kBatches = 4;  // step i uses batch i % 4
  tensors["bench.tokens"] =
      at::randint(config.vocab_size, {kBatches, opt.batch, opt.seq + 1}, gen, at::kLong);
  checkpoint::safetensors::save_file(tensors, path, {{"config", config.to_json()}});
}

std::string fmt(double v, int precision) {
  if (std::isnan(v) || v < 0)
    return "-";  // -1: not reported (the PyTorch worker times whole steps)
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", precision, v);
  return buf;
}

// The variants' worker processes, started and ready (or left out, for (d)).
std::vector<Variant> start_variants(const Options& opt, const char* self,
                                    const std::string& inputs) {
  namespace launch = dtensor::launch;
  const std::string lr = std::to_string(opt.lr);
  auto cpp_worker = [&](const std::string& kind) {
    return std::vector<std::string>{self, "--worker", kind, "--inputs", inputs, "--lr", lr};
  };
  const launch::Env one_thread = {{"OMP_NUM_THREADS", "1"}, {"MKL_NUM_THREADS", "1"}};
  auto rank_env = [&](int rank, int world, int port) {
    auto env = launch::rank_env(rank, world, port);
    env.insert(env.end(), one_thread.begin(), one_thread.end());
    return env;
  };

  std::vector<Variant> variants(kVariants);
  variants[kPlain].label = "(a) plain LibTorch";
  variants[kPlain].procs.push_back(spawn(cpp_worker("plain"), one_thread, true));
  variants[kTp1].label = "(b) dtensor TP=1";
  variants[kTp1].procs.push_back(
      spawn(cpp_worker("tp"), rank_env(0, 1, launch::free_port()), true));
  // Two ranks of worker `kind` over Gloo, on a port of their own.
  auto gloo_pair = [&](int index, const std::string& label, const std::string& kind) {
    variants[index].label = label;
    const int port = launch::free_port();
    for (int r = 0; r < 2; ++r) {
      auto env = rank_env(r, 2, port);
      env.emplace_back("DTENSOR_BACKEND", "gloo");
      variants[index].procs.push_back(spawn(cpp_worker(kind), env, r == 0));
    }
  };
  gloo_pair(kTp2Gloo, "(c) dtensor TP=2 Gloo", "tp");
  gloo_pair(kTp2GlooOverlap, "(f) TP=2 Gloo overlap", "tp-overlap");
  gloo_pair(kFsdp2Gloo, "(e) dtensor FSDP=2 Gloo", "fsdp");
  variants[kTp2Mpi].label = "(c') dtensor TP=2 MPI";
  variants[kTp2MpiOverlap].label = "(f') TP=2 MPI overlap";
  for (const auto& [index, kind] :
       {std::pair{kTp2Mpi, "tp"}, std::pair{kTp2MpiOverlap, "tp-overlap"}}) {
    if (!dtensor::comm::has_mpi() || !opt.mpi) break;
    // mpirun starts both ranks (bound to a core each); rank 0 reads our commands.
    std::vector<std::string> argv = {MPIEXEC_PATH, "-np", "2"};
    if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
    const std::vector<std::string> vars = {"OMP_NUM_THREADS=1", "MKL_NUM_THREADS=1",
                                           "DTENSOR_BACKEND=mpi", "MASTER_ADDR=127.0.0.1",
                                           "MASTER_PORT=" + std::to_string(launch::free_port())};
    for (const auto& var : vars) {
      argv.push_back("-x");
      argv.push_back(var);
    }
    auto worker = cpp_worker(kind);
    worker[0] = std::filesystem::read_symlink("/proc/self/exe").string();  // not mpirun's self
    argv.insert(argv.end(), worker.begin(), worker.end());
    variants[index].procs.push_back(spawn(argv, one_thread, true));
  }
  variants[kPy].label = "(d) PyTorch TP=2 Gloo";
  if (opt.pytorch) {
    variants[kPy].procs.push_back(spawn({"python3", dtensor::bench::find_script(opt.script),
                                         "--serve", "--tp", "2", "--inputs", inputs, "--lr", lr},
                                        one_thread, true));
  }
  for (auto& v : variants) {
    if (v.procs.empty()) continue;
    auto line = read_line(v.procs.front().out);
    v.alive = line && line->rfind("ready", 0) == 0;
    if (v.alive) {
      v.ready = *line;
    } else {
      v.fail(line ? "replied '" + *line + "' instead of ready" : "exited while starting");
    }
  }
  for (int i : {kPlain, kTp1, kTp2Gloo}) {
    if (!variants[i].alive) die(variants[i].label + " could not start");
  }
  return variants;
}

void print_intro(const Options& opt, const models::DecoderConfig& config) {
  std::printf(
      "bench_train_step: Llama preset \"%s\" (%lld parameters), batch %lld x %lld tokens,"
      " AdamW lr %g\n",
      opt.preset.c_str(), static_cast<long long>(config.num_parameters()),
      static_cast<long long>(opt.batch), static_cast<long long>(opt.seq), opt.lr);
  std::printf(
      "one intra-op thread per rank; Gloo on 127.0.0.1; %d warm-up step(s), then %d "
      "rounds of %d step(s) per variant\n",
      opt.warmup, opt.rounds, opt.steps);
  if (opt.busy > 0) {
    std::printf("busy machine: %d process(es) spinning beside the variants at nice %d\n", opt.busy,
                opt.busy_nice);
  }
  std::printf(
      "rounds alternate a b c f e c' f' d / d f' c' e f c b a; ms/step = median over rounds of the "
      "slowest "
      "rank's block time / steps\n\n");
  std::fflush(stdout);
}

// A process that only spins on the CPU at nice value `nice`, until killed or until the
// controller exits: another program's work on the machine.
pid_t start_busy_loop(int nice) {
  const pid_t pid = ::fork();
  if (pid < 0) die(std::string("fork: ") + std::strerror(errno));
  if (pid > 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  errno = 0;
  if (nice != 0 && ::nice(nice) == -1 && errno != 0) ::_exit(1);
  volatile uint64_t spins = 0;
  for (;;) spins = spins + 1;
}

// Warm-up, then the rounds: a b c f e c' f' d / d f' c' e f c b a, so that each variant runs first
// half of the time.
void run_rounds(const Options& opt, std::vector<Variant>& variants) {
  for (auto& v : variants) {
    if (auto b = v.run(opt.warmup)) v.warmup_losses = b->losses;
  }
  for (int r = 0; r < opt.rounds; ++r) {
    const int n = static_cast<int>(variants.size());
    for (int i = 0; i < n; ++i) {
      auto& v = variants[r % 2 == 0 ? i : n - 1 - i];
      if (auto b = v.run(opt.steps)) v.rounds.push_back(*b);
    }
  }
}

void print_report(const Options& opt, const std::vector<Variant>& variants) {
  const double tokens = static_cast<double>(opt.batch * opt.seq);
  auto med = [](const Variant& v, double Block::*field) {
    std::vector<double> xs;
    for (const auto& b : v.rounds) xs.push_back(b.*field);
    return v.rounds.empty() ? std::nan("") : median(xs);
  };
  // Median over rounds of x_r / y_r (rounds where both ran).
  auto ratio = [](const Variant& x, const Variant& y) {
    std::vector<double> rs;
    for (size_t i = 0; i < std::min(x.rounds.size(), y.rounds.size()); ++i)
      rs.push_back(x.rounds[i].ms_per_step / y.rounds[i].ms_per_step);
    return median(rs);
  };
  const Variant &a = variants[kPlain], &b = variants[kTp1], &c = variants[kTp2Gloo],
                &m = variants[kTp2Mpi], &d = variants[kPy], &e = variants[kFsdp2Gloo],
                &f = variants[kTp2GlooOverlap], &fm = variants[kTp2MpiOverlap];

  std::printf("%-24s %10s %10s %9s %9s %9s %9s %11s\n", "variant", "ms/step", "tokens/s",
              "vs plain", "forward", "backward", "optim", "DTensor ops");
  std::printf("%s\n", std::string(24 + 10 * 2 + 9 * 4 + 11 + 7, '-').c_str());
  for (const auto& v : variants) {
    if (v.rounds.empty()) {
      std::printf("%-24s %10s   (not run)\n", v.label.c_str(), "-");
      continue;
    }
    const double ms = med(v, &Block::ms_per_step);
    const double ops = med(v, &Block::dtensor_ops);
    std::printf("%-24s %10s %10s %8sx %9s %9s %9s %11s\n", v.label.c_str(), fmt(ms, 1).c_str(),
                fmt(tokens / ms * 1000.0, 1).c_str(), fmt(ratio(v, a), 3).c_str(),
                fmt(med(v, &Block::forward_ms), 1).c_str(),
                fmt(med(v, &Block::backward_ms), 1).c_str(),
                fmt(med(v, &Block::optimizer_ms), 1).c_str(), ops < 0 ? "-" : fmt(ops, 0).c_str());
  }
  std::printf(
      "(forward/backward/optim: rank 0's ms per step in each phase, median; backward "
      "includes the loss\n and, for dtensor TP, reduce_partial_grads; DTensor ops: "
      "dispatches through the DTensor kernel per step on rank 0's main thread)\n\n");

  std::printf("per-round ms/step:\n");
  for (const auto& v : variants) {
    if (v.rounds.empty()) continue;
    std::printf("  %-24s", v.label.c_str());
    for (const auto& blk : v.rounds) std::printf(" %8.1f", blk.ms_per_step);
    std::printf("\n");
  }

  // Numerics: identical parameters and data, so the losses agree up to float rounding.
  std::printf(
      "\nloss at the first step and after the last (step %d), and the largest difference"
      " from (a) over all steps:\n",
      opt.warmup + opt.rounds * opt.steps);
  for (const auto& v : variants) {
    if (v.all_losses.empty()) continue;
    double worst = 0;
    for (size_t i = 0; i < std::min(v.all_losses.size(), a.all_losses.size()); ++i)
      worst = std::max(worst, std::abs(v.all_losses[i] - a.all_losses[i]));
    std::printf("  %-24s first %.6f  last %.6f  max |diff vs (a)| %.2e\n", v.label.c_str(),
                v.all_losses.front(), v.all_losses.back(), worst);
  }
  if (!d.all_losses.empty()) {
    std::printf("  first-step loss (c) - (d): %+.3e\n",
                c.all_losses.front() - d.all_losses.front());
  }

  const double overhead = (ratio(b, a) - 1.0) * 100.0;
  const double speedup = d.rounds.empty() ? std::nan("") : ratio(d, c);
  std::printf("\ntp1 overhead (median over rounds of (b-a)/a): %+.2f%%  (target <= 3%%)\n",
              overhead);
  if (!opt.pytorch) {
    std::printf("PyTorch TP=2 skipped (--no-pytorch)\n");
  } else if (d.rounds.empty()) {
    std::printf("PyTorch TP=2 did not run: is python3 with torch installed? (see stderr)\n");
  } else {
    std::printf("speedup over PyTorch TP=2 (median over rounds of d/c): %.3fx  (target > 1)\n",
                speedup);
  }
  // TP=2 tokens/s over plain LibTorch's, per engine; unsuffixed: the faster engine that ran.
  const double vs_plain_gloo = ratio(a, c);
  const double vs_plain_mpi = m.rounds.empty() ? std::nan("") : ratio(a, m);
  const double vs_plain =
      std::isnan(vs_plain_mpi) ? vs_plain_gloo : std::max(vs_plain_gloo, vs_plain_mpi);
  std::printf(
      "TP=2 tokens/s over plain LibTorch's (median over rounds of a/c): Gloo %.3fx, MPI %sx "
      " (2 cores: at most 2)\n",
      vs_plain_gloo, fmt(vs_plain_mpi, 3).c_str());
  // The same model and global batch: FSDP's tokens/s over TP's, both on 2 ranks over Gloo.
  const double fsdp_vs_tp = e.rounds.empty() ? std::nan("") : ratio(c, e);
  std::printf("FSDP dp=2 tokens/s over TP=2's (median over rounds of c/e, Gloo): %sx\n",
              fmt(fsdp_vs_tp, 3).c_str());
  // TP=2 with overlap_comm: the plain TP=2 step time over the overlapped one, per engine.
  const double overlap_gloo = f.rounds.empty() ? std::nan("") : ratio(c, f);
  const double overlap_mpi = fm.rounds.empty() || m.rounds.empty() ? std::nan("") : ratio(m, fm);
  std::printf(
      "TP=2 with overlap_comm, speedup over without (median over rounds of c/f, c'/f'): "
      "Gloo %sx, MPI %sx\n",
      fmt(overlap_gloo, 3).c_str(), fmt(overlap_mpi, 3).c_str());
  if (!f.all_losses.empty()) {
    // Losses travel as float32 with 9 significant digits: equal text is the same float.
    bool same = f.all_losses.size() == c.all_losses.size();
    for (size_t i = 0; same && i < f.all_losses.size(); ++i)
      same = f.all_losses[i] == c.all_losses[i];
    std::printf("losses of (f) and (c) %s\n", same ? "bitwise equal" : "DIFFER");
  }
  auto or_nan = [](double v) { return std::isnan(v) ? std::string("nan") : fmt(v, 3); };
  std::printf(
      "RESULT tp1_overhead_pct=%.2f speedup_vs_pytorch_tp2=%s tp2_vs_tp1_plain=%.3f "
      "tp2_vs_tp1_plain_gloo=%.3f tp2_vs_tp1_plain_mpi=%s fsdp2_vs_tp2_gloo=%s "
      "overlap_speedup=%s overlap_speedup_mpi=%s busy=%d\n",
      overhead, d.rounds.empty() ? "nan" : fmt(speedup, 3).c_str(), vs_plain, vs_plain_gloo,
      std::isnan(vs_plain_mpi) ? "nan" : fmt(vs_plain_mpi, 3).c_str(),
      std::isnan(fsdp_vs_tp) ? "nan" : fmt(fsdp_vs_tp, 3).c_str(), or_nan(overlap_gloo).c_str(),
      or_nan(overlap_mpi).c_str(), opt.busy);
  std::fflush(stdout);
}

int run_controller(const Options& opt, const char* self) {
  const auto config = models::DecoderConfig::preset(opt.preset);
  config.validate_tp(2);
  TORCH_CHECK(opt.seq % 2 == 0 && opt.seq <= config.max_seq_len, "--seq must be even (sequence ",
              "parallel on 2 ranks) and at most max_seq_len=", config.max_seq_len);
  TORCH_CHECK(opt.batch % 2 == 0, "--batch must be even (FSDP on 2 ranks splits it), got ",
              opt.batch);
  char dir_template[] = "/tmp/bench_train_step.XXXXXX";
  if (!::mkdtemp(dir_template)) die(std::string("mkdtemp: ") + std::strerror(errno));
  const std::string dir = dir_template, inputs = dir + "/inputs.safetensors";
  write_inputs(opt, config, inputs);

  // SIGTERM and the like reach the workers, whose end then ends the controller.
  g_children.forward_termination_signals();
  ::signal(SIGPIPE, SIG_IGN);  // a dead worker shows up as a failed write, not a signal

  std::vector<Variant> variants = start_variants(opt, self, inputs);
  print_intro(opt, config);
  dtensor::launch::Children busy_loops;
  for (int i = 0; i < opt.busy; ++i) busy_loops.add(start_busy_loop(opt.busy_nice));
  run_rounds(opt, variants);
  busy_loops.signal_running(SIGKILL);
  busy_loops.wait_all({});
  for (auto& v : variants) v.quit();
  g_children.wait_all({});
  dtensor::checkpoint::remove_directory(dir);
  for (int i : {kPlain, kTp1, kTp2Gloo}) {
    if (variants[i].rounds.size() != static_cast<size_t>(opt.rounds))
      die(variants[i].label + " failed part-way; no RESULT");
  }
  print_report(opt, variants);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  namespace cli = dtensor::cli;
  Options opt;
  CLI::App app("", "bench_train_step");
  auto* preset =
      app.add_option("--preset", opt.preset)->check(cli::one_of({"tiny", "demo", "bench"}));
  app.add_option("--batch", opt.batch)->check(cli::integer(1));
  auto* seq = app.add_option("--seq", opt.seq)->check(cli::integer(2));
  auto* warmup = app.add_option("--warmup", opt.warmup)->check(cli::integer(1, 1 << 30));
  auto* steps = app.add_option("--steps", opt.steps)->check(cli::integer(1, 1 << 30));
  auto* rounds = app.add_option("--rounds", opt.rounds)->check(cli::integer(1, 1 << 30));
  app.add_option("--lr", opt.lr)->check(cli::number(0, 10, /*min_open=*/true));
  app.add_option("--seed", opt.seed)->check(cli::integer(0));
  app.add_option("--pytorch-script", opt.script)->check(cli::non_empty());
  app.add_flag_callback("--no-pytorch", [&] { opt.pytorch = false; })->disable_flag_override();
  app.add_flag_callback("--no-mpi", [&] { opt.mpi = false; })->disable_flag_override();
  app.add_option("--busy", opt.busy)->check(cli::integer(0, 64));
  app.add_option("--busy-nice", opt.busy_nice)->check(cli::integer(0, 19));
  bool quick = false;
  app.add_flag("--quick", quick)->disable_flag_override();
  // The controller starts itself as the workers with these.
  app.add_option("--worker", opt.worker)->check(cli::one_of({"plain", "tp", "tp-overlap", "fsdp"}));
  app.add_option("--inputs", opt.inputs)->check(cli::non_empty());
  if (auto code = cli::parse(app, argc, argv, kUsage)) return *code;
  if (quick) {  // a smoke test; options given explicitly win
    if (preset->count() == 0) opt.preset = "tiny";
    if (seq->count() == 0) opt.seq = 32;
    if (warmup->count() == 0) opt.warmup = 1;
    if (steps->count() == 0) opt.steps = 1;
    if (rounds->count() == 0) opt.rounds = 2;
  }
  try {
    if (!opt.worker.empty()) return run_worker(opt);
    return run_controller(opt, "/proc/self/exe");
  } catch (const c10::Error& e) {
    std::cerr << "bench_train_step: " << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "bench_train_step: " << e.what() << std::endl;
  }
  return 1;  // g_children's destructor stops and reaps the workers
}
