// Checkpoints of modules with DTensor parameters: round trips between TP degrees (1, 2, 4
// ranks, a 2x2 mesh, uneven shards) give the single-device values bit for bit; optimizer
// state resumes training exactly; damaged files and modules that do not fit fail with clear
// errors and leave the module untouched; a failed save leaves the previous file; the
// CheckpointManager keeps the last N and falls back past a damaged newest file.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
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
#include <map>
#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/models/checkpoint.h"
#include "dtensor/models/checkpoint_manager.h"
#include "dtensor/models/crc32c.h"
#include "dtensor/models/safetensors.h"
#include "support/distributed.h"
#include "support/temp_dir.h"

using namespace dtensor;
using namespace dtensor::models;
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

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {  // a caller's own exception, rethrown as it was
    return e.what();
  }
  return "(no error)";
}
#define EXPECT_HAS(text, part)                               \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "expected \"" << (part) << "\" in:\n"               \
      << (text)

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
  models::safetensors::File f(path);
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
  EXPECT_HAS(meta.entries.at("placements"), R"j("0.weight":"Shard(dim=0)")j");
  EXPECT_HAS(meta.entries.at("placements"), R"j("2.weight":"Shard(dim=1)")j");
  EXPECT_HAS(meta.entries.at("placements"), R"j("2.bias":"Replicate()")j");
  EXPECT_HAS(read_checkpoint_metadata(dir.file("dp2tp2.safetensors")).entries.at("placements"),
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
  std::string err = error_of([&] { load_checkpoint(flipped, *model); });
  EXPECT_HAS(err, flipped);
  EXPECT_HAS(err, "tensor \"2.weight\" is corrupt");
  EXPECT_TRUE(bitwise_equal(global_values(*model), before));
  EXPECT_HAS(error_of([&] { verify_checkpoint(flipped); }), "\"2.weight\" is corrupt");

  const std::string truncated = dir.file("truncated.safetensors");
  fs::copy_file(good, truncated);
  fs::resize_file(truncated, fs::file_size(good) - 10);
  err = error_of([&] { load_checkpoint(truncated, *model); });
  EXPECT_HAS(err, truncated);
  EXPECT_HAS(err, "is truncated");
  EXPECT_TRUE(bitwise_equal(global_values(*model), before));

  const std::string header = dir.file("header.safetensors");
  fs::copy_file(good, header);
  flip_byte(header, 8 + 3);  // inside the JSON
  err = error_of([&] { load_checkpoint(header, *model); });
  EXPECT_HAS(err, header);
  EXPECT_TRUE(bitwise_equal(global_values(*model), before));

  // Damage to the checksums themselves is caught too.
  const std::string sums = dir.file("sums.safetensors");
  {
    auto t = models::safetensors::load_file(good);
    auto meta = models::safetensors::File(good).metadata();
    meta.at("checksums").replace(meta.at("checksums").find("\"0.bias\":\"") + 10, 1, "g");
    models::safetensors::save_file(t, sums, meta);
  }
  EXPECT_HAS(error_of([&] { load_checkpoint(sums, *model); }), "\"0.bias\" is corrupt");
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
    const std::string err = error_of([&] { load_checkpoint(path, *model); });
    EXPECT_HAS(err, path);
    EXPECT_HAS(err, "nothing loaded");
    for (const auto& p : parts) EXPECT_HAS(err, p);
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
  EXPECT_HAS(error_of([&] { load_checkpoint(path, *model, sgd.get()); }),
             "holds AdamW optimizer state; it cannot be loaded into SGD");
  torch::optim::AdamW partial(std::vector<at::Tensor>{model->parameters()[0]});
  EXPECT_HAS(error_of([&] { load_checkpoint(path, *model, &partial); }),
             "optimizer param group 0 held [0.weight, 0.bias, 2.weight, 2.bias] when saved; now "
             "it holds [0.weight]");
  const std::string no_state = dir.file("no_state.safetensors");
  save_checkpoint(no_state, *mlp(kDim, kHidden, 0));
  auto adamw = make_opt(OptKind::AdamWAmsgrad, model);
  EXPECT_HAS(error_of([&] { load_checkpoint(no_state, *model, adamw.get()); }),
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
    const std::string err = error_of([&] { save_checkpoint(path, *model, nullptr, failing); });
    EXPECT_HAS(err, "simulated disk failure");
    if (rank == 1) {
      EXPECT_HAS(err, "failed on rank 0");
    }
    // The step-1 file is intact and no temporary is left behind.
    EXPECT_EQ(read_checkpoint_metadata(path).step, 1);
    EXPECT_NO_THROW(verify_checkpoint(path));
    EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
    // A directory that does not exist fails on every rank as well.
    EXPECT_HAS(error_of([&] { save_checkpoint(dir.file("no/such/dir.safetensors"), *model); }),
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
          EXPECT_HAS(why, "\"0.weight\" is corrupt");
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
      error_of([&] { manager.load_latest(*model, nullptr, {}, [](auto&, auto&) {}); });
  EXPECT_HAS(err, "no intact checkpoint");
  EXPECT_HAS(err, "\"2.bias\" is corrupt");
}

// The checksums cover exactly each tensor's bytes in the file, so any tool can check them.
TEST(Checkpoint, ChecksumsAreCrc32cOfEachTensorsBytes) {
  TempDir dir;
  const std::string path = dir.file("c.safetensors");
  save_checkpoint(path, *mlp(kDim, kHidden, 0));
  models::safetensors::File f(path);
  EXPECT_EQ(f.metadata().at("checksum_algorithm"), "crc32c");
  const std::string sums = f.metadata().at("checksums");
  for (const auto& info : f.tensors()) {
    const auto b = f.bytes(info);
    char hex[9];
    std::snprintf(hex, sizeof(hex), "%08x", crc32c(b.data(), b.size()));
    EXPECT_HAS(sums, "\"" + info.name + "\":\"" + hex + "\"");
  }
}
