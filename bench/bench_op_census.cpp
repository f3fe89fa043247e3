// bench_op_census: the ATen ops one training step of a Llama preset makes the device run
// (dispatch::OpCensus: leaf ops by name, a DTensor op counted as the local ops it runs), side by
// side: (a) plain LibTorch, the model without tensor parallelism, and (b) dtensor-cpp TP on a
// 1-rank mesh (sequence parallel, loss parallel: every parameter a DTensor). A step is zero_grad,
// forward, cross entropy, backward, (b) reduce_partial_grads, clipping on the device and
// torch::optim::AdamW's step, counted after one warm-up step. Issue 41's aim is (b) = (a) op for
// op; the table lists every op whose counts differ, the largest differences first.
//
//   build/bench/bench_op_census [--preset bench] [--batch 2] [--seq 64]
//
// Last line: RESULT plain_ops=<a> tp1_ops=<b> extra_ops=<b - a> ratio=<b / a> kinds_differing=<n>
#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "common/local_ranks.h"
#include "dtensor/dtensor.h"

namespace {

namespace models = dtensor::models;
using Counts = std::map<std::string, int64_t>;

struct Options {
  std::string preset = "bench";
  int64_t batch = 2, seq = 64;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_op_census: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--preset") {
      o.preset = value();
    } else if (a == "--batch") {
      o.batch = std::stoll(value());
    } else if (a == "--seq") {
      o.seq = std::stoll(value());
    } else {
      std::fprintf(stderr,
                   "usage: bench_op_census [--preset NAME] [--batch N] [--seq N]\n"
                   "bench_op_census: unknown argument '%s'\n",
                   a.c_str());
      std::exit(2);
    }
  }
  return o;
}

// The census of the second of two identical steps.
Counts census_of_step(models::TransformerImpl& model, bool tensor_parallel,
                      const at::Tensor& tokens, const at::Tensor& targets) {
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  auto step = [&] {
    opt.zero_grad();
    models::loss_and_backward(model.forward(tokens), targets);
    if (tensor_parallel) models::reduce_partial_grads(model);
    dtensor::nn::utils::clip_grad_norm_on_device_(model.parameters(), 1.0);
    opt.step();
  };
  step();
  dtensor::dispatch::OpCensus census;
  step();
  return census.counts();
}

int64_t total(const Counts& c) {
  int64_t n = 0;
  for (const auto& [name, k] : c) n += k;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  at::set_num_threads(1);
  // A world of one rank, rendezvous on a free loopback port.
  for (const auto& [key, value] : dtensor::launch::rank_env(0, 1, dtensor::launch::free_port()))
    setenv(key.c_str(), value.c_str(), 1);
  dtensor::comm::init_process_group();
  const auto config = models::DecoderConfig::preset(opt.preset);
  at::manual_seed(0);
  const at::Tensor batch = at::randint(config.vocab_size, {opt.batch, opt.seq + 1});
  const at::Tensor tokens = batch.slice(1, 0, -1), targets = batch.slice(1, 1);

  models::Transformer plain(config), tp1(config);
  plain->init_weights(1);
  tp1->init_weights(1);
  models::apply_tensor_parallel(*tp1, dtensor::init_device_mesh("cpu", {1}));
  const Counts a = census_of_step(*plain, false, tokens, targets);
  const Counts b = census_of_step(*tp1, true, tokens, targets);

  struct Row {
    std::string name;
    int64_t plain, tp1;
  };
  std::vector<Row> rows;
  Counts all = a;
  for (const auto& [name, k] : b) all.emplace(name, 0);
  for (const auto& [name, k] : all) {
    const int64_t x = a.count(name) ? a.at(name) : 0, y = b.count(name) ? b.at(name) : 0;
    if (x != y) rows.push_back({name, x, y});
  }
  std::sort(rows.begin(), rows.end(), [](const Row& l, const Row& r) {
    return std::llabs(l.tp1 - l.plain) > std::llabs(r.tp1 - r.plain);
  });
  std::printf("bench_op_census: preset \"%s\", batch %lld x %lld tokens, one training step\n",
              opt.preset.c_str(), static_cast<long long>(opt.batch),
              static_cast<long long>(opt.seq));
  std::printf("%-44s %10s %10s %10s\n", "op (counts that differ)", "plain", "tp1", "tp1-plain");
  for (const Row& r : rows)
    std::printf("%-44s %10lld %10lld %+10lld\n", r.name.c_str(), static_cast<long long>(r.plain),
                static_cast<long long>(r.tp1), static_cast<long long>(r.tp1 - r.plain));
  const int64_t na = total(a), nb = total(b);
  std::printf("%-44s %10lld %10lld %+10lld\n", "all ops", static_cast<long long>(na),
              static_cast<long long>(nb), static_cast<long long>(nb - na));
  std::printf("RESULT plain_ops=%lld tp1_ops=%lld extra_ops=%lld ratio=%.3f kinds_differing=%zu\n",
              static_cast<long long>(na), static_cast<long long>(nb),
              static_cast<long long>(nb - na), na > 0 ? static_cast<double>(nb) / na : 0.0,
              rows.size());
  dtensor::comm::destroy_process_group();
  return 0;
}
