// bench_checkpoint: save/load time of a ~10M-parameter MLP checkpoint (with AdamW state).
//
//   build/bench/bench_checkpoint [--dir DIR] [--reps N]          one process, plain tensors
//   python -m torch.distributed.run --no-python --nproc-per-node 2 build/bench/bench_checkpoint
//                                                                 TP=2 (Megatron layout)
//
// The model is Linear(1024, 4864) - ReLU - Linear(4864, 1024) in float32 (9.96M parameters);
// at more than one rank the first Linear is colwise and the second rowwise. Each rep times
// save_checkpoint (gather + write + fsync + rename), verify_checkpoint (CRC-32C of every
// tensor), load_checkpoint (read, check, copy local chunks), without and with the AdamW
// state (3x the bytes). Times are the slowest rank's; the table shows the median over reps.
// The last line is machine-readable:
//   RESULT ckpt_ranks=<n> ckpt_params=<n> save_ms=<> load_ms=<> save_opt_ms=<> load_opt_ms=<> ...
#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/cli.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/checkpoint/crc32c.h"
#include "dtensor/dtensor.h"

namespace {

constexpr const char* kUsage = R"(usage: bench_checkpoint [--dir DIR] [--reps N]

Times save_checkpoint, verify_checkpoint and load_checkpoint of a ~10M-parameter MLP (float32),
without and with its AdamW state; the table shows the median over the reps, each the slowest
rank's. Alone it is one process with plain tensors; under a launcher (RANK set, e.g.
`dtrun -n 2`) the MLP is tensor-parallel (first Linear colwise, second rowwise).

The last line is:
  RESULT ckpt_ranks=<n> ckpt_params=<n> save_ms=<> load_ms=<> save_opt_ms=<> load_opt_ms=<> ...

options:
  --dir DIR   where the checkpoint files go (default: the temporary directory)
  --reps N    repetitions (default 5)
  --help      print this help
)";

using Clock = std::chrono::steady_clock;

// Milliseconds of `f`, the slowest rank's (all ranks start together).
double timed_ms(const std::function<void()>& f, bool distributed) {
  if (distributed) dtensor::comm::barrier();
  const auto t0 = Clock::now();
  f();
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (distributed) {
    ms = dtensor::comm::all_reduce(at::scalar_tensor(ms, at::kDouble), dtensor::ReduceOp::Max,
                                   *dtensor::comm::world_group())
             .item<double>();
  }
  return ms;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = std::filesystem::temp_directory_path().string();
  int reps = 5;
  CLI::App app("", "bench_checkpoint");
  app.add_option("--dir", dir)->check(dtensor::cli::non_empty());
  app.add_option("--reps", reps)->check(dtensor::cli::integer(1, 1000000));
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) return *code;
  const bool distributed = std::getenv("RANK") != nullptr;
  int rank = 0, world = 1;
  if (distributed) {
    dtensor::comm::init_process_group();
    rank = dtensor::comm::get_rank();
    world = dtensor::comm::get_world_size();
  }
  at::set_num_threads(1);

  constexpr int64_t kDim = 1024, kHidden = 4864;
  at::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(kDim, kHidden), torch::nn::ReLU(),
                              torch::nn::Linear(kHidden, kDim));
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  if (world > 1) {
    auto mesh = dtensor::init_device_mesh("cpu", {world}, {"tp"});
    using dtensor::Replicate;
    using dtensor::Shard;
    const std::vector<std::pair<int, std::vector<dtensor::Placement>>> layout = {{0, {Shard(0)}},
                                                                                 {2, {Shard(1)}}};
    for (const auto& [index, weight] : layout) {
      auto& lin = *model[index]->as<torch::nn::Linear>();
      dtensor::replace_parameter(lin, "weight",
                                 dtensor::distribute_tensor(lin.weight.detach(), mesh, weight));
      dtensor::replace_parameter(lin, "bias",
                                 dtensor::distribute_tensor(lin.bias.detach(), mesh,
                                                            {index == 0 ? Shard(0) : Replicate()}));
    }
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  {  // one step so that the optimizer has state
    auto x = at::randn({8, kDim});
    if (world > 1)
      x = dtensor::distribute_tensor(x, dtensor::device_mesh(model->parameters()[0]),
                                     {dtensor::Replicate()});
    model->forward(x).sum().backward();
    opt.step();
  }

  const std::string path =
      (std::filesystem::path(dir) / ("bench_ckpt_" + std::to_string(world) + ".safetensors"))
          .string();
  std::vector<double> save, load, verify, save_opt, load_opt;
  for (int r = 0; r < reps; ++r) {
    save.push_back(
        timed_ms([&] { dtensor::checkpoint::save_checkpoint(path, *model); }, distributed));
    verify.push_back(timed_ms([&] { dtensor::checkpoint::verify_checkpoint(path); }, distributed));
    load.push_back(
        timed_ms([&] { dtensor::checkpoint::load_checkpoint(path, *model); }, distributed));
    save_opt.push_back(
        timed_ms([&] { dtensor::checkpoint::save_checkpoint(path, *model, &opt); }, distributed));
    load_opt.push_back(
        timed_ms([&] { dtensor::checkpoint::load_checkpoint(path, *model, &opt); }, distributed));
  }
  const double file_mb_opt = static_cast<double>(std::filesystem::file_size(path)) / 1e6;
  dtensor::checkpoint::save_checkpoint(path, *model);
  const double file_mb = static_cast<double>(std::filesystem::file_size(path)) / 1e6;

  // CRC-32C throughput on its own (what verification adds per byte).
  std::vector<uint8_t> buf(64 << 20, 1);
  const double crc_ms =
      timed_ms([&] { dtensor::checkpoint::crc32c(buf.data(), buf.size()); }, false);

  if (rank == 0) {
    std::printf("checkpoint of a %.2fM-parameter MLP, %d rank(s), %d reps, in %s\n", params / 1e6,
                world, reps, dir.c_str());
    std::printf("%-28s %10s %10s %10s\n", "", "MB", "median ms", "MB/s");
    auto row = [](const char* what, double mb, double ms) {
      std::printf("%-28s %10.1f %10.1f %10.0f\n", what, mb, ms, mb / (ms / 1e3));
    };
    row("save (weights)", file_mb, median(save));
    row("verify (weights)", file_mb, median(verify));
    row("load (weights)", file_mb, median(load));
    row("save (weights + AdamW)", file_mb_opt, median(save_opt));
    row("load (weights + AdamW)", file_mb_opt, median(load_opt));
    row("crc32c (64 MiB buffer)", 67.108864, crc_ms);
    std::printf(
        "RESULT ckpt_ranks=%d ckpt_params=%lld save_ms=%.1f verify_ms=%.1f load_ms=%.1f "
        "save_opt_ms=%.1f load_opt_ms=%.1f crc32c_gbps=%.2f\n",
        world, static_cast<long long>(params), median(save), median(verify), median(load),
        median(save_opt), median(load_opt), 67.108864 / crc_ms);
    std::filesystem::remove(path);
  }
  if (distributed) dtensor::comm::destroy_process_group();
  return 0;
}
