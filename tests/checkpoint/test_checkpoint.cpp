// Checkpoints of modules with DTensor parameters: round trips between TP degrees (1, 2, 4
// ranks, a 2x2 mesh, uneven shards) give the single-device values bit for bit; optimizer
// state resumes training exactly; damaged files and modules that do not fit fail with clear
// errors and leave the module untouched; a failed save leaves the previous file; the
// CheckpointManager keeps the last N and falls back past a damaged newest file.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/checkpoint/checkpoint_manager.h"
#include "dtensor/checkpoint/crc32c.h"
#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/temp_dir.h"

using namespace dtensor;
using namespace dtensor::checkpoint;
using namespace dtensor::testing;
namespace fs = std::filesystem;

namespace {

// Linear(dim, hidden) - ReLU - Linear(hidden, dim), initialised from `seed`.
torch::nn::Sequential mlp(int64_t dim, int64_t hidden, uint64_t seed,
                          c10::ScalarType dtype = at::kFloat, bool bias = true) {
  at::manual_seed(seed);
  torch::nn::Sequential m(torch::nn::Linear(torch::nn::LinearOptions(dim, hidden).bias(bias)),
                          torch::nn::ReLU(), torch::nn::Linear(hidden, dim));
  m->to(dtype);
  return m;
}

using Plan = std::map<std::string, Placements>;
const Placements R{Replicate()}, S0{Shard(0)}, S1{Shard(1)};
// Megatron: colwise then rowwise; and the transposed layout.
const Plan kMegatron{{"0.weight", S0}, {"0.bias", S0}, {"2.weight", S1}, {"2.bias", R}};
const Plan kSwapped{{"0.weight", S1}, {"0.bias", R}, {"2.weight", S0}, {"2.bias", S0}};

// Swaps every parameter for a DTensor laid out as `plan` says (others replicated).
void shard(torch::nn::Module& root, const DeviceMesh& mesh, const Plan& plan) {
  for (const auto& item : root.named_modules()) {
    torch::nn::Module& m = *item.value();
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      const std::string full = item.key().empty() ? p.key() : item.key() + "." + p.key();
      auto it = plan.find(full);
      const Placements pl = it == plan.end() ? replicate_all(mesh.ndim()) : it->second;
      replace_parameter(m, p.key(), distribute_tensor(p.value().detach(), mesh, pl));
    }
  }
}

// Global values of every parameter (full_tensor of DTensors; collective).
std::map<std::string, at::Tensor> global_values(const torch::nn::Module& m) {
  at::NoGradGuard g;
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    out[p.key()] = is_dtensor(p.value()) ? full_tensor(p.value()) : p.value().clone();
  }
  return out;
}

::testing::AssertionResult bitwise_equal(const std::map<std::string, at::Tensor>& actual,
                                         const std::map<std::string, at::Tensor>& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << actual.size() << " tensors, expected " << expected.size();
  }
  for (const auto& [name, e] : expected) {
    auto it = actual.find(name);
    if (it == actual.end()) return ::testing::AssertionFailure() << "no tensor " << name;
    if (!it->second.equal(e)) {
      return ::testing::AssertionFailure()
             << name << " differs: max |diff| " << (it->second - e).abs().max().item<double>();
    }
  }
  return ::testing::AssertionSuccess();
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}
uint64_t data_offset_of(const std::string& path, const std::string& tensor) {
  checkpoint::safetensors::File f(path);
  return f.data_offset() + f.at(tensor).begin;
}

// The reference values: one device, seed 0. hidden = 10 shards unevenly on 4 ranks (3,3,3,1).
constexpr int64_t kDim = 6, kHidden = 10;
std::map<std::string, at::Tensor> reference_values() {
  return global_values(*mlp(kDim, kHidden, /*seed=*/0));
}

}  // namespace

TEST(Checkpoint, RoundTripsBetweenTpDegreesBitForBit) {
  TempDir dir;
  const auto expected = reference_values();
  // Save the seed-0 model from 1 rank (plain), 2 and 4 ranks (Megatron layout), and 2x2.
  for (int world : {1, 2, 4}) {
    run_ranks(world, [&](int rank) {
      auto model = mlp(kDim, kHidden, 0);
      if (world > 1) {
        auto mesh = init_device_mesh("cpu", {world}, {"tp"});
        shard(*model, mesh, kMegatron);
      }
      CommDebugMode comm;
      save_checkpoint(dir.file("tp" + std::to_string(world) + ".safetensors"), *model, nullptr,
                      {.config = R"({"dim": 6})", .step = 7, .metadata = {{"run", "a"}}});
      comm.exit();
      if (world > 1) {
        // One all_gather per sharded parameter (2.bias is replicated), one status broadcast.
        EXPECT_EQ(comm.get_comm_counts(),
                  (CommCounts{{CommType::all_gather_into_tensor, 3}, {CommType::broadcast, 1}}))
            << comm.table();
      }
      // All ranks return after the file is complete: any rank can read it at once.
      EXPECT_NO_THROW(verify_checkpoint(dir.file("tp" + std::to_string(world) + ".safetensors")));
    });
  }
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto model = mlp(kDim, kHidden, 0);
    shard(*model, mesh,
          {{"0.weight", {Shard(0), Shard(1)}},
           {"0.bias", {Replicate(), Shard(0)}},
           {"2.weight", {Replicate(), Shard(1)}}});
    save_checkpoint(dir.file("dp2tp2.safetensors"), *model, nullptr, {.step = 7});
  });

  // Metadata of the 2-rank file.
  const auto meta = read_checkpoint_metadata(dir.file("tp2.safetensors"));
  EXPECT_EQ(meta.config, R"({"dim": 6})");
  EXPECT_EQ(meta.step, 7);
  EXPECT_EQ(meta.tp_degree, 2);
  EXPECT_EQ(meta.world_size, 2);
  EXPECT_EQ(meta.format_version, kCheckpointFormatVersion);
  EXPECT_EQ(meta.entries.at("run"), "a");
  EXPECT_CONTAINS(meta.entries.at("placements"), R"j("0.weight":"Shard(dim=0)")j");
  EXPECT_CONTAINS(meta.entries.at("placements"), R"j("2.weight":"Shard(dim=1)")j");
  EXPECT_CONTAINS(meta.entries.at("placements"), R"j("2.bias":"Replicate()")j");
  EXPECT_CONTAINS(read_checkpoint_metadata(dir.file("dp2tp2.safetensors")).entries.at("placements"),
                  R"j("0.weight":"Shard(dim=0), Shard(dim=1)")j");
  EXPECT_EQ(read_checkpoint_metadata(dir.file("dp2tp2.safetensors")).tp_degree, 2);
  EXPECT_EQ(read_checkpoint_metadata(dir.file("tp1.safetensors")).tp_degree, 1);

  // Every file holds the global tensors: the single-device values.
  for (const char* f : {"tp1", "tp2", "tp4", "dp2tp2"}) {
    SCOPED_TRACE(f);
    auto plain = mlp(kDim, kHidden, /*seed=*/1);  // other values until loaded
    const auto pointers = plain->parameters();
    load_checkpoint(dir.file(std::string(f) + ".safetensors"), *plain);  // no process group
    EXPECT_TRUE(bitwise_equal(global_values(*plain), expected));
    const auto after = plain->parameters();
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].is_same(pointers[i]));
  }

  // Load each file at other degrees and layouts, without communication.
  struct Load {
    std::string file;
    int world;
    std::vector<int64_t> mesh;
    Plan plan;
  };
  const std::vector<Load> loads = {
      {"tp2", 4, {4}, kMegatron},
      {"tp2", 4, {4}, kSwapped},
      {"tp1", 4, {4}, kMegatron},
      {"tp4", 2, {2}, kMegatron},
      {"tp4", 2, {2}, kSwapped},
      {"tp2", 1, {1}, kMegatron},
      {"tp4", 4, {2, 2}, {{"0.weight", {Shard(1), Shard(0)}}, {"2.weight", {Shard(0), Shard(0)}}}},
      {"dp2tp2", 2, {2}, kMegatron},
  };
  for (const auto& l : loads) {
    SCOPED_TRACE(l.file + " on mesh " + c10::str(c10::IntArrayRef(l.mesh)));
    run_ranks(l.world, [&](int) {
      auto mesh = init_device_mesh("cpu", l.mesh);
      auto model = mlp(kDim, kHidden, /*seed=*/1);
      shard(*model, mesh, l.plan);
      std::vector<at::Tensor> locals;
      for (const auto& p : model->parameters()) locals.push_back(local_tensor(p));
      CommDebugMode comm;
      const auto m = load_checkpoint(dir.file(l.file + ".safetensors"), *model);
      comm.exit();
      EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
      EXPECT_EQ(m.step, 7);
      // Copied into the same local tensors, keeping their layout.
      const auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(local_tensor(params[i]).is_same(locals[i]));
      }
      EXPECT_TRUE(bitwise_equal(global_values(*model), expected));
    });
  }
}

// Trains `steps` steps from step `first` on data that depends only on the step number.
void train(torch::nn::Sequential& model, torch::optim::Optimizer& opt,
           const std::optional<DeviceMesh>& mesh, int first, int steps) {
  for (int step = first; step < first + steps; ++step) {
    at::manual_seed(1000 + step);
    at::Tensor x = at::randn({4, kDim}, at::kDouble);
    at::Tensor w = at::randn({4, kDim}, at::kDouble);
    if (mesh) {
      x = distribute_tensor(x, *mesh, {Replicate()});
      w = distribute_tensor(w, *mesh, {Replicate()});
    }
    opt.zero_grad();
    (model->forward(x) * w).sum().backward();
    opt.step();
  }
}

enum class OptKind { AdamWAmsgrad, Adam, SGD };
std::unique_ptr<torch::optim::Optimizer> make_opt(OptKind k, const torch::nn::Sequential& m) {
  switch (k) {
    case OptKind::AdamWAmsgrad:
      return std::make_unique<torch::optim::AdamW>(
          m->parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01).amsgrad(true));
    case OptKind::Adam:
      return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(0.05));
    case OptKind::SGD:
      return std::make_unique<torch::optim::SGD>(m->parameters(),
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return nullptr;
}
const char* opt_name(OptKind k) {
  return k == OptKind::AdamWAmsgrad ? "AdamW(amsgrad)" : k == OptKind::Adam ? "Adam" : "SGD";
}

TEST(Checkpoint, ResumedTrainingContinuesExactlyLikeAnUninterruptedRun) {
  TempDir dir;
  for (OptKind kind : {OptKind::AdamWAmsgrad, OptKind::Adam, OptKind::SGD}) {
    SCOPED_TRACE(opt_name(kind));
    const std::string path = dir.file(std::string(opt_name(kind)) + ".safetensors");
    std::map<std::string, at::Tensor> single_device;  // 3 + 3 steps on one device
    {
      auto model = mlp(kDim, kHidden, 0, at::kDouble);
      auto opt = make_opt(kind, model);
      train(model, *opt, std::nullopt, 0, 3);
      opt->param_groups()[0].options().set_lr(0.02);
      train(model, *opt, std::nullopt, 3, 3);
      single_device = global_values(*model);
    }
    run_ranks(2, [&](int) {
      auto mesh = init_device_mesh("cpu", {2});
      auto model = mlp(kDim, kHidden, 0, at::kDouble);
      shard(*model, mesh, kMegatron);
      auto opt = make_opt(kind, model);
      train(model, *opt, mesh, 0, 3);
      // A schedule changed the learning rate: the checkpoint restores it.
      opt->param_groups()[0].options().set_lr(0.02);
      save_checkpoint(path, *model, opt.get(), {.step = 3});
      train(model, *opt, mesh, 3, 3);
      const auto uninterrupted = global_values(*model);

      auto resumed = mlp(kDim, kHidden, /*seed=*/1, at::kDouble);
      shard(*resumed, mesh, kMegatron);
      auto resumed_opt = make_opt(kind, resumed);
      const auto meta = load_checkpoint(path, *resumed, resumed_opt.get());
      EXPECT_EQ(meta.step, 3);
      EXPECT_EQ(resumed_opt->param_groups()[0].options().get_lr(), 0.02);
      // The state tensors have their parameters' layouts.
      for (const auto& p : resumed->parameters()) {
        auto it = resumed_opt->state().find(p.unsafeGetTensorImpl());
        ASSERT_NE(it, resumed_opt->state().end());
        at::Tensor state;
        if (kind == OptKind::AdamWAmsgrad) {
          const auto& s = dynamic_cast<const torch::optim::AdamWParamState&>(*it->second);
          state = s.max_exp_avg_sq();
          EXPECT_EQ(s.step(), 3);
        } else if (kind == OptKind::Adam) {
          const auto& s = dynamic_cast<const torch::optim::AdamParamState&>(*it->second);
          state = s.exp_avg();
          EXPECT_EQ(s.step(), 3);
        } else {
          state = dynamic_cast<const torch::optim::SGDParamState&>(*it->second).momentum_buffer();
        }
        ASSERT_TRUE(is_dtensor(state));
        EXPECT_EQ(placements(state), placements(p));
      }
      train(resumed, *resumed_opt, mesh, 3, 3);
      EXPECT_TRUE(bitwise_equal(global_values(*resumed), uninterrupted));
      // And close to one device (the sharded sums round differently).
      for (const auto& [name, t] : uninterrupted) {
        EXPECT_TENSOR_CLOSE(t, single_device.at(name), 1e-10, 1e-12);
      }
    });
  }
}

// dtensor::optim::CapturableAdamW saves as AdamW: its checkpoint resumes torch::optim::AdamW and
// AdamW's resumes it (the step count back in a float64 tensor on the parameter's device), at
// TP 2, each resumed run continuing as the uninterrupted one.
TEST(Checkpoint, CapturableAdamWStateInterchangesWithAdamW) {
  TempDir dir;
  const auto options = torch::optim::AdamWOptions(0.05).weight_decay(0.01).amsgrad(true);
  auto make = [&](bool capturable, const torch::nn::Sequential& m)
      -> std::unique_ptr<torch::optim::Optimizer> {
    if (capturable) return std::make_unique<optim::CapturableAdamW>(m->parameters(), options);
    return std::make_unique<torch::optim::AdamW>(m->parameters(), options);
  };
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    for (bool saved_by_capturable : {true, false}) {
      SCOPED_TRACE(saved_by_capturable ? "CapturableAdamW -> AdamW" : "AdamW -> CapturableAdamW");
      const std::string path = dir.file(saved_by_capturable ? "c.safetensors" : "a.safetensors");
      auto model = mlp(kDim, kHidden, 0, at::kDouble);
      shard(*model, mesh, kMegatron);
      auto opt = make(saved_by_capturable, model);
      train(model, *opt, mesh, 0, 3);
      save_checkpoint(path, *model, opt.get(), {.step = 3});
      train(model, *opt, mesh, 3, 3);
      const auto uninterrupted = global_values(*model);

      auto resumed = mlp(kDim, kHidden, /*seed=*/1, at::kDouble);
      shard(*resumed, mesh, kMegatron);
      auto resumed_opt = make(!saved_by_capturable, resumed);
      load_checkpoint(path, *resumed, resumed_opt.get());
      if (saved_by_capturable) {
        for (const auto& p : resumed->parameters()) {
          const auto& s = dynamic_cast<const torch::optim::AdamWParamState&>(
              *resumed_opt->state().at(p.unsafeGetTensorImpl()));
          EXPECT_EQ(s.step(), 3);
        }
      } else {
        for (const auto& p : resumed->parameters()) {
          const auto& s = dynamic_cast<const optim::CapturableAdamWParamState&>(
              *resumed_opt->state().at(p.unsafeGetTensorImpl()));
          EXPECT_EQ(s.step().scalar_type(), at::kDouble);
          EXPECT_EQ(s.step().device(), local_tensor(p).device());
          EXPECT_EQ(s.step().item<double>(), 3);
          EXPECT_EQ(placements(s.max_exp_avg_sq()), placements(p));
        }
      }
      train(resumed, *resumed_opt, mesh, 3, 3);
      for (const auto& [name, t] : global_values(*resumed)) {
        EXPECT_TENSOR_CLOSE(t, uninterrupted.at(name), 1e-12, 1e-12);
      }
    }
  });
}

TEST(Checkpoint, TrainingResumesAtAnotherTpDegree) {
  TempDir dir;
  const std::string path = dir.file("adamw.safetensors");
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto model = mlp(kDim, kHidden, 0, at::kDouble);
    shard(*model, mesh, kMegatron);
    auto opt = make_opt(OptKind::AdamWAmsgrad, model);
    train(model, *opt, mesh, 0, 3);
    save_checkpoint(path, *model, opt.get(), {.step = 3});
  });
  // Resumed on one device: the reference for the 4-rank resume.
  auto ref = mlp(kDim, kHidden, 1, at::kDouble);
  auto ref_opt = make_opt(OptKind::AdamWAmsgrad, ref);
  load_checkpoint(path, *ref, ref_opt.get());
  train(ref, *ref_opt, std::nullopt, 3, 3);
  const auto expected = global_values(*ref);
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto model = mlp(kDim, kHidden, 1, at::kDouble);
    shard(*model, mesh, kSwapped);
    auto opt = make_opt(OptKind::AdamWAmsgrad, model);
    load_checkpoint(path, *model, opt.get());
    train(model, *opt, mesh, 3, 3);
    for (const auto& [name, t] : global_values(*model)) {
      EXPECT_TENSOR_CLOSE(t, expected.at(name), 1e-10, 1e-12);
    }
  });
}

TEST(Checkpoint, DamagedFilesFailNamingFileAndTensorAndLeaveTheModuleUntouched) {
  TempDir dir;
  const std::string good = dir.file("good.safetensors");
  save_checkpoint(good, *mlp(kDim, kHidden, 0));  // one process, no process group
  auto model = mlp(kDim, kHidden, 1);
  const auto before = global_values(*model);

  const std::string flipped = dir.file("flipped.safetensors");
  fs::copy_file(good, flipped);
  flip_byte(flipped, data_offset_of(flipped, "2.weight") + 5);
  std::string err = message_of([&] { load_checkpoint(flipped, *model); });
  EXPECT_CONTAINS(err, flipped);
  EXPECT_CONTAINS(err, "tensor \"2.weight\" is corrupt");
  EXPECT_TRUE(bitwise_equal(global_values(*model), before));
  EXPECT_CONTAINS(message_of([&] { verify_checkpoint(flipped); }), "\"2.weight\" is corrupt");

  const std::string truncated = dir.file("truncated.safetensors");
  fs::copy_file(good, truncated);
  fs::resize_file(truncated, fs::file_size(good) - 10);
  err = message_of([&] { load_checkpoint(truncated, *model); });
  EXPECT_CONTAINS(err, truncated);
  EXPECT_CONTAINS(err, "is truncated");
  EXPECT_TRUE(bitwise_equal(global_values(*model), before));

  const std::string header = dir.file("header.safetensors");
  fs::copy_file(good, header);
  flip_byte(header, 8 + 3);  // inside the JSON
  err = message_of([&] { load_checkpoint(header, *model); });
  EXPECT_CONTAINS(err, header);
  EXPECT_TRUE(bitwise_equal(global_values(*model), before));

  // Damage to the checksums themselves is caught too (by the header checksum).
  const std::string sums = dir.file("sums.safetensors");
  {
    auto t = checkpoint::safetensors::load_file(good);
    auto meta = checkpoint::safetensors::File(good).metadata();
    meta.at("checksums").replace(meta.at("checksums").find("\"0.bias\":\"") + 10, 1, "g");
    checkpoint::safetensors::save_file(t, sums, meta);
  }
  err = message_of([&] { load_checkpoint(sums, *model); });
  EXPECT_CONTAINS(err, sums);
  EXPECT_CONTAINS(err, "header checksum does not match");
  EXPECT_TRUE(bitwise_equal(global_values(*model), before));

  load_checkpoint(good, *model);
  EXPECT_TRUE(bitwise_equal(global_values(*model), reference_values()));
}

TEST(Checkpoint, ModulesThatDoNotFitAreRejectedWithEveryProblemListed) {
  TempDir dir;
  const std::string path = dir.file("mlp.safetensors");
  std::map<std::string, at::Tensor> saved;
  {
    auto model = mlp(kDim, kHidden, 0);
    auto opt = make_opt(OptKind::AdamWAmsgrad, model);
    opt->zero_grad();
    model->forward(at::randn({2, kDim})).sum().backward();
    opt->step();
    save_checkpoint(path, *model, opt.get());
    saved = global_values(*model);  // after one step: not the seed-0 values
  }
  auto check_rejected = [&](torch::nn::Sequential model, std::vector<std::string> parts) {
    const auto before = global_values(*model);
    const std::string err = message_of([&] { load_checkpoint(path, *model); });
    EXPECT_CONTAINS(err, path);
    EXPECT_CONTAINS(err, "nothing loaded");
    for (const auto& p : parts) EXPECT_CONTAINS(err, p);
    EXPECT_TRUE(bitwise_equal(global_values(*model), before));
  };
  check_rejected(
      mlp(kDim, 12, 1),
      {"shape mismatch:", "0.weight: checkpoint [10, 6], module [12, 6]",
       "0.bias: checkpoint [10], module [12]", "2.weight: checkpoint [6, 10], module [6, 12]"});
  check_rejected(mlp(kDim, kHidden, 1, at::kFloat, /*bias=*/false),
                 {"unexpected in the checkpoint:\n    0.bias"});
  auto longer = mlp(kDim, kHidden, 1);
  longer->push_back(torch::nn::Linear(kDim, 3));
  check_rejected(longer, {"missing in the checkpoint:\n    3.weight\n    3.bias"});
  // Non-strict loading takes what fits and leaves the rest.
  const auto extra_before = longer[3]->as<torch::nn::Linear>()->weight.clone();
  load_checkpoint(path, *longer, nullptr, {.strict = false});
  EXPECT_TRUE(longer[3]->as<torch::nn::Linear>()->weight.equal(extra_before));
  EXPECT_TRUE(longer[0]->as<torch::nn::Linear>()->weight.equal(saved.at("0.weight")));

  // Optimizers: another type, other parameters, or a file without optimizer state.
  auto model = mlp(kDim, kHidden, 1);
  const auto before = global_values(*model);
  auto sgd = make_opt(OptKind::SGD, model);
  EXPECT_CONTAINS(message_of([&] { load_checkpoint(path, *model, sgd.get()); }),
                  "holds AdamW optimizer state; it cannot be loaded into SGD");
  torch::optim::AdamW partial(std::vector<at::Tensor>{model->parameters()[0]});
  EXPECT_CONTAINS(
      message_of([&] { load_checkpoint(path, *model, &partial); }),
      "optimizer param group 0 held [0.weight, 0.bias, 2.weight, 2.bias] when saved; now "
      "it holds [0.weight]");
  const std::string no_state = dir.file("no_state.safetensors");
  save_checkpoint(no_state, *mlp(kDim, kHidden, 0));
  auto adamw = make_opt(OptKind::AdamWAmsgrad, model);
  EXPECT_CONTAINS(message_of([&] { load_checkpoint(no_state, *model, adamw.get()); }),
                  "holds no optimizer state");
  EXPECT_TRUE(bitwise_equal(global_values(*model), before));
  EXPECT_TRUE(adamw->state().empty());
  // The weights alone load from a file with optimizer state.
  load_checkpoint(path, *model);
  EXPECT_TRUE(bitwise_equal(global_values(*model), saved));
}

TEST(Checkpoint, AFailedSaveLeavesThePreviousFileOnEveryRank) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto model = mlp(kDim, kHidden, 0);
    shard(*model, mesh, kMegatron);
    save_checkpoint(path, *model, nullptr, {.step = 1});
    {
      at::NoGradGuard g;
      for (auto& p : model->parameters()) p.add_(1.0);
    }
    int written = 0;
    SaveOptions failing{.step = 2};
    failing.on_tensor_written = [&](const std::string&, size_t, size_t) {
      if (++written == 2) throw std::runtime_error("simulated disk failure");
    };
    const std::string err = message_of([&] { save_checkpoint(path, *model, nullptr, failing); });
    EXPECT_CONTAINS(err, "simulated disk failure");
    if (rank == 1) {
      EXPECT_CONTAINS(err, "failed on rank 0");
    }
    // The step-1 file is intact and no temporary is left behind.
    EXPECT_EQ(read_checkpoint_metadata(path).step, 1);
    EXPECT_NO_THROW(verify_checkpoint(path));
    EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
    // A directory that does not exist fails on every rank as well.
    EXPECT_CONTAINS(
        message_of([&] { save_checkpoint(dir.file("no/such/dir.safetensors"), *model); }),
        "cannot create");
  });
  auto plain = mlp(kDim, kHidden, 1);
  load_checkpoint(path, *plain);
  EXPECT_TRUE(bitwise_equal(global_values(*plain), reference_values()));
}

TEST(Checkpoint, ManagerKeepsTheLastNAndFallsBackPastADamagedNewest) {
  TempDir dir;
  const std::string ckdir = dir.file("ckpts");
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto model = mlp(kDim, kHidden, 0);
    shard(*model, mesh, kMegatron);
    CheckpointManager manager(ckdir, /*keep_last=*/2);
    EXPECT_FALSE(manager.load_latest(*model).has_value());  // nothing yet: a fresh start
    for (int64_t step : {100, 200, 300}) {
      {
        at::NoGradGuard g;
        for (auto& p : model->parameters()) p.fill_(static_cast<double>(step));
      }
      EXPECT_EQ(manager.save(step, *model, nullptr, {.config = "cfg"}), manager.path_for(step));
      // Every rank sees the new pointer on return.
      EXPECT_EQ(manager.latest(), manager.path_for(step));
    }
    const auto files = manager.list();
    ASSERT_EQ(files.size(), 2u);
    EXPECT_EQ(files[0].first, 200);
    EXPECT_EQ(files[1].first, 300);
  });
  EXPECT_EQ(fs::path(ckdir).filename(), "ckpts");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(ckdir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_000200.safetensors",
                                             "step_000300.safetensors"}));

  // Damage the newest: loading falls back to step 200, saying why.
  CheckpointManager manager(ckdir, 2);
  const std::string newest = manager.path_for(300);
  flip_byte(newest, data_offset_of(newest, "0.weight"));
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto model = mlp(kDim, kHidden, 1);
    shard(*model, mesh, kSwapped);
    std::vector<std::string> skipped;
    const auto meta =
        manager.load_latest(*model, nullptr, {}, [&](const std::string& p, const std::string& why) {
          skipped.push_back(p);
          EXPECT_CONTAINS(why, "\"0.weight\" is corrupt");
        });
    ASSERT_TRUE(meta.has_value());
    EXPECT_EQ(meta->step, 200);
    EXPECT_EQ(meta->config, "cfg");
    EXPECT_EQ(skipped, std::vector<std::string>{newest});
    for (const auto& [name, t] : global_values(*model)) {
      EXPECT_TRUE(t.equal(at::full_like(t, 200.0))) << name;
    }
  });
  // Nothing intact: an error, not a silent fresh start.
  const std::string older = manager.path_for(200);
  flip_byte(older, data_offset_of(older, "2.bias"));
  auto model = mlp(kDim, kHidden, 1);
  const std::string err =
      message_of([&] { manager.load_latest(*model, nullptr, {}, [](auto&, auto&) {}); });
  EXPECT_CONTAINS(err, "no intact checkpoint");
  EXPECT_CONTAINS(err, "\"2.bias\" is corrupt");
}

// The checksums cover exactly each tensor's bytes in the file, so any tool can check them.
TEST(Checkpoint, ChecksumsAreCrc32cOfEachTensorsBytes) {
  TempDir dir;
  const std::string path = dir.file("c.safetensors");
  save_checkpoint(path, *mlp(kDim, kHidden, 0));
  checkpoint::safetensors::File f(path);
  EXPECT_EQ(f.metadata().at("checksum_algorithm"), "crc32c");
  const std::string sums = f.metadata().at("checksums");
  for (const auto& info : f.tensors()) {
    const auto b = f.bytes(info);
    char hex[9];
    std::snprintf(hex, sizeof(hex), "%08x", crc32c(b.data(), b.size()));
    EXPECT_CONTAINS(sums, "\"" + info.name + "\":\"" + hex + "\"");
  }
}

namespace {

// Replaces the first `from` in the file's bytes by `to` (same length), e.g. a digit of the
// header's metadata; fails the test when `from` is absent.
void edit_bytes(const std::string& path, const std::string& from, const std::string& to) {
  std::string bytes = read_file(path);
  const size_t at = bytes.find(from);
  ASSERT_NE(at, std::string::npos) << "\"" << from << "\" not in " << path;
  ASSERT_EQ(from.size(), to.size());
  bytes.replace(at, from.size(), to);
  write_file(path, bytes);
}

// A small model after one AdamW step at lr 0.001, saved at step 1.
void save_trained(const std::string& path) {
  auto model = mlp(kDim, kHidden, 0);
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(0.001).weight_decay(0.01).amsgrad(true));
  at::manual_seed(5);
  model->forward(at::randn({2, kDim})).sum().backward();
  opt.step();
  save_checkpoint(path, *model, &opt, {.config = R"({"dim": 6})", .step = 1});
}

bool identical(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.equal(b);
}

// Everything loading `path` into a fresh model and AdamW gives back: the parameters, the
// optimizer's state and options, and the metadata (as tensors and strings).
struct Loaded {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> strings;
};
Loaded load_everything(const std::string& path) {
  auto model = mlp(kDim, kHidden, /*seed=*/1);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.5));
  const CheckpointMetadata meta = load_checkpoint(path, *model, &opt);
  Loaded out;
  for (const auto& p : model->named_parameters()) {
    out.tensors[p.key()] = p.value().detach().clone();
    auto it = opt.state().find(p.value().unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;
    const auto& s = dynamic_cast<const torch::optim::AdamWParamState&>(*it->second);
    out.tensors[p.key() + "/exp_avg"] = s.exp_avg();
    out.tensors[p.key() + "/exp_avg_sq"] = s.exp_avg_sq();
    if (s.max_exp_avg_sq().defined()) out.tensors[p.key() + "/max_exp_avg_sq"] = s.max_exp_avg_sq();
    out.tensors[p.key() + "/step"] = at::tensor(s.step());
  }
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(opt.param_groups()[0].options());
  out.tensors["lr"] = at::tensor(o.lr(), at::kDouble);
  out.tensors["betas"] = at::tensor({std::get<0>(o.betas()), std::get<1>(o.betas())}, at::kDouble);
  out.tensors["eps"] = at::tensor(o.eps(), at::kDouble);
  out.tensors["weight_decay"] = at::tensor(o.weight_decay(), at::kDouble);
  out.tensors["amsgrad"] = at::tensor(static_cast<int64_t>(o.amsgrad()));
  out.strings = meta.entries;
  out.strings["(config)"] = meta.config;
  out.strings["(step)"] = std::to_string(meta.step);
  out.strings["(tp_degree)"] = std::to_string(meta.tp_degree);
  out.strings["(world_size)"] = std::to_string(meta.world_size);
  out.strings["(format_version)"] = std::to_string(meta.format_version);
  return out;
}

// Empty when identical, otherwise the first difference.
std::string difference(const Loaded& a, const Loaded& b) {
  if (a.strings != b.strings) {
    for (const auto& [k, v] : a.strings) {
      auto it = b.strings.find(k);
      if (it == b.strings.end()) return "metadata \"" + k + "\" appeared";
      if (it->second != v) return "metadata \"" + k + "\": " + v + " -> " + it->second;
    }
    return "metadata entries disappeared";
  }
  if (a.tensors.size() != b.tensors.size()) return "another number of tensors";
  for (const auto& [k, t] : a.tensors) {
    auto it = b.tensors.find(k);
    if (it == b.tensors.end()) return "no tensor " + k;
    if (!identical(t, it->second)) return "tensor " + k + " changed";
  }
  return "";
}

}  // namespace

// The metadata is covered by a checksum: an edit of the step or of the learning rate in the
// JSON header is caught, not loaded.
TEST(Checkpoint, EditedStepOrLearningRateInTheHeaderFailsNamingTheFile) {
  TempDir dir;
  const std::string good = dir.file("good.safetensors");
  save_trained(good);
  ASSERT_EQ(load_everything(good).tensors.at("lr").item<double>(), 0.001);

  struct Edit {
    std::string name, from, to;
  };
  for (const Edit& e : {Edit{"step", R"("step":"1")", R"("step":"7")"},
                        Edit{"lr", R"(\"lr\":0.001)", R"(\"lr\":0.009)"}}) {
    SCOPED_TRACE(e.name);
    const std::string path = dir.file(e.name + ".safetensors");
    fs::copy_file(good, path);
    edit_bytes(path, e.from, e.to);
    auto model = mlp(kDim, kHidden, 1);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.5));
    const auto before = global_values(*model);
    const std::string err = message_of([&] { load_checkpoint(path, *model, &opt); });
    EXPECT_CONTAINS(err, path);
    EXPECT_CONTAINS(err, "header checksum");
    EXPECT_TRUE(bitwise_equal(global_values(*model), before));
    EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 0.5);
    EXPECT_TRUE(opt.state().empty());
    EXPECT_CONTAINS(message_of([&] { read_checkpoint_metadata(path); }), path);
    EXPECT_CONTAINS(message_of([&] { verify_checkpoint(path); }), path);
  }
}

// Any single flipped bit anywhere in the file is either an error or changes nothing that is
// read back (e.g. a padding space): never a silently different model, optimizer or metadata.
TEST(Checkpoint, NoSingleBitFlipLoadsSilentlyChangedValues) {
  TempDir dir;
  const std::string good = dir.file("good.safetensors");
  save_trained(good);
  const Loaded expected = load_everything(good);
  const std::string bytes = read_file(good);
  const uint64_t header_end = checkpoint::safetensors::File(good).data_offset();

  std::mt19937_64 rng(20261124);
  constexpr int kFlips = 300;
  int runs = 0, errors = 0, unchanged = 0, in_header = 0;
  std::vector<std::string> silent;
  const std::string path = dir.file("flipped.safetensors");
  for (int i = 0; i < kFlips; ++i) {
    const uint64_t bit = rng() % (bytes.size() * 8);
    std::string damaged = bytes;
    damaged[bit / 8] = static_cast<char>(damaged[bit / 8] ^ (1u << (bit % 8)));
    write_file(path, damaged);
    ++runs;
    in_header += bit / 8 < header_end;
    Loaded got;
    try {
      got = load_everything(path);
    } catch (const c10::Error& e) {
      ++errors;
      EXPECT_CONTAINS(e.what_without_backtrace(), path);
      continue;
    }
    const std::string diff = difference(expected, got);
    if (diff.empty()) {
      ++unchanged;
    } else {
      silent.push_back("byte " + std::to_string(bit / 8) + " bit " + std::to_string(bit % 8) +
                       ": " + diff);
    }
  }
  RecordProperty("errors", errors);
  RecordProperty("unchanged", unchanged);
  RecordProperty("in_header", in_header);
  EXPECT_EQ(runs, kFlips);
  EXPECT_GT(in_header, kFlips / 4);  // the header is a good part of this small file
  EXPECT_EQ(errors + unchanged, kFlips);
  EXPECT_TRUE(silent.empty()) << silent.size() << " silent changes:\n" << c10::Join("\n", silent);
}

// Hugging Face writes {"format": "pt"} into every file's metadata; our checkpoints carry it
// too, and files with it (or with only it) load.
TEST(Checkpoint, FilesWithFormatPtMetadataLoad) {
  TempDir dir;
  const std::string ours = dir.file("ours.safetensors");
  save_checkpoint(ours, *mlp(kDim, kHidden, 0), nullptr, {.step = 4});
  EXPECT_EQ(checkpoint::safetensors::File(ours).metadata().at("format"), "pt");

  // Our metadata plus "format": "pt", written again by another writer in the same layout
  // (the header checksum covers the offsets, so the tensors keep their order).
  const std::string rewritten = dir.file("rewritten.safetensors");
  {
    checkpoint::safetensors::File f(ours);
    auto meta = f.metadata();
    meta["format"] = "pt";
    std::vector<checkpoint::safetensors::Writer::Entry> entries;
    for (const auto& info : f.tensors()) entries.push_back({info.name, info.dtype, info.shape});
    checkpoint::safetensors::Writer w(rewritten, entries, meta);
    for (const auto& info : f.tensors()) w.write(f.tensor(info));
    w.finish(meta);
  }
  auto model = mlp(kDim, kHidden, 1);
  EXPECT_EQ(load_checkpoint(rewritten, *model).step, 4);
  EXPECT_TRUE(bitwise_equal(global_values(*model), reference_values()));

  // A plain Hugging Face file: tensors and {"format": "pt"} alone, no checksums.
  const std::string plain = dir.file("plain.safetensors");
  checkpoint::safetensors::save_file(checkpoint::safetensors::load_file(ours), plain,
                                     {{"format", "pt"}});
  const auto meta = read_checkpoint_metadata(plain);
  EXPECT_EQ(meta.format_version, 0);
  EXPECT_EQ(meta.entries.at("format"), "pt");
  auto other = mlp(kDim, kHidden, 1);
  EXPECT_EQ(load_checkpoint(plain, *other).format_version, 0);
  EXPECT_TRUE(bitwise_equal(global_values(*other), reference_values()));
}

// Files of checkpoint format 1 have no checksum over their metadata, so damage to it cannot
// be told from the real thing: they are refused with a message saying why and what to do.
// So is a file with our metadata but without the entry that names the format.
TEST(Checkpoint, FilesWithUncheckedMetadataAreRefused) {
  TempDir dir;
  const std::string ours = dir.file("ours.safetensors");
  save_checkpoint(ours, *mlp(kDim, kHidden, 0), nullptr, {.step = 4});
  const auto tensors = checkpoint::safetensors::load_file(ours);
  auto meta = checkpoint::safetensors::File(ours).metadata();

  const std::string v1 = dir.file("v1.safetensors");
  auto v1_meta = meta;
  v1_meta.erase("checkpoint_format");
  v1_meta.erase("header_checksum");
  v1_meta["format"] = "dtensor-checkpoint";
  v1_meta["format_version"] = "1";
  checkpoint::safetensors::save_file(tensors, v1, v1_meta);
  auto model = mlp(kDim, kHidden, 1);
  const auto before = global_values(*model);
  std::string err = message_of([&] { load_checkpoint(v1, *model); });
  EXPECT_CONTAINS(err, v1);
  EXPECT_CONTAINS(err, "format version 1");
  EXPECT_CONTAINS(err, "safetensors::load_file");
  EXPECT_CONTAINS(message_of([&] { read_checkpoint_metadata(v1); }), "format version 1");

  const std::string unnamed = dir.file("unnamed.safetensors");
  auto unnamed_meta = meta;
  unnamed_meta.erase("checkpoint_format");
  checkpoint::safetensors::save_file(tensors, unnamed, unnamed_meta);
  err = message_of([&] { load_checkpoint(unnamed, *model); });
  EXPECT_CONTAINS(err, unnamed);
  EXPECT_CONTAINS(err, "\"checkpoint_format\"");
  EXPECT_TRUE(bitwise_equal(global_values(*model), before));
}

// Non-strict loading that matches no name at all loads nothing: an error listing names from
// both sides, not a silent success.
TEST(Checkpoint, NonStrictLoadingThatMatchesNothingFails) {
  TempDir dir;
  const std::string path = dir.file("mlp.safetensors");
  save_checkpoint(path, *mlp(kDim, kHidden, 0));
  torch::nn::Sequential other(torch::nn::ReLU(), torch::nn::ReLU(), torch::nn::ReLU(),
                              torch::nn::Linear(kDim, 3));  // "3.weight", "3.bias"
  auto wrapped = std::make_shared<torch::nn::Module>();     // the same layers as "0.0.weight", ...
  wrapped->register_module("0", mlp(kDim, kHidden, 1).ptr());
  const std::vector<std::pair<std::shared_ptr<torch::nn::Module>, std::string>> cases = {
      {other.ptr(), "3.weight"}, {wrapped, "0.0.weight"}};
  for (const auto& [model, module_name] : cases) {
    const auto before = global_values(*model);
    const std::string err =
        message_of([&] { load_checkpoint(path, *model, nullptr, {.strict = false}); });
    EXPECT_CONTAINS(err, path);
    EXPECT_CONTAINS(err, "no tensor name in common");
    EXPECT_CONTAINS(err, "0.weight");   // in the checkpoint
    EXPECT_CONTAINS(err, module_name);  // in the module
    EXPECT_TRUE(bitwise_equal(global_values(*model), before));
  }
}

// Like PyTorch's load_state_dict(strict=False): what fits loads, and the names that did not
// match come back (optimizer state in the file counts only when an optimizer is given).
TEST(Checkpoint, NonStrictLoadingReportsMissingAndUnexpectedNames) {
  TempDir dir;
  const std::string path = dir.file("mlp.safetensors");
  save_trained(path);
  const auto saved = checkpoint::safetensors::load_file(path);
  auto model = mlp(kDim, kHidden, 1, at::kFloat, /*bias=*/false);  // no "0.bias"
  model->push_back(torch::nn::Linear(kDim, 3));                    // "3.weight", "3.bias"
  const at::Tensor extra = model[3]->as<torch::nn::Linear>()->weight.clone();
  const auto meta = load_checkpoint(path, *model, nullptr, {.strict = false});
  EXPECT_EQ(meta.missing_keys, (std::vector<std::string>{"3.weight", "3.bias"}));
  EXPECT_EQ(meta.unexpected_keys, std::vector<std::string>{"0.bias"});
  EXPECT_EQ(meta.step, 1);
  EXPECT_TRUE(model[0]->as<torch::nn::Linear>()->weight.equal(saved.at("0.weight")));
  EXPECT_TRUE(model[2]->as<torch::nn::Linear>()->bias.equal(saved.at("2.bias")));
  EXPECT_TRUE(model[3]->as<torch::nn::Linear>()->weight.equal(extra));

  // Strict loading of the same fails, naming both sides.
  const std::string err = message_of([&] { load_checkpoint(path, *model); });
  EXPECT_CONTAINS(err, "missing in the checkpoint:\n    3.weight\n    3.bias");
  EXPECT_CONTAINS(err, "unexpected in the checkpoint:\n    0.bias");

  // Everything matches: nothing to report.
  const auto exact = load_checkpoint(path, *mlp(kDim, kHidden, 1), nullptr, {.strict = false});
  EXPECT_TRUE(exact.missing_keys.empty());
  EXPECT_TRUE(exact.unexpected_keys.empty());
}
