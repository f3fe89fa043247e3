// dtensor_train's Trainer: a few AdamW steps of the tiny Llama with tensor parallelism (and
// dp x tp, and FSDP) against the same Trainer on one device with plain LibTorch: losses,
// gradient norms and every parameter afterwards; with activation checkpointing too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/corpus.h"
#include "common/run_config.h"
#include "common/tokenizer.h"
#include "common/trainer.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/checkpoint/checkpoint_manager.h"
#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/temp_dir.h"
#include "train/checkpoints.h"

using namespace dtensor;
using namespace dtensor::train;
using dtensor::testing::run_ranks;
using dtensor::testing::TempDir;

namespace {

RunConfig tiny_config(int64_t world, int64_t dp, bool sequence_parallel, bool loss_parallel,
                      int64_t dp_shard = 1) {
  TrainOptions o;
  o.dp_shard = dp_shard;
  o.preset = "tiny";
  o.steps = 4;
  o.batch_size = 4;
  o.seq_len = 32;
  o.dp = dp;
  o.sequence_parallel = sequence_parallel;
  o.loss_parallel = loss_parallel;
  o.warmup = 1;
  o.dtype = "float64";  // differences then come from the code, not float32 rounding
  return resolve_run_config(o, world);
}

// Trains `cfg.steps` steps on `mesh` and on one device; compares as it goes.
void expect_like_one_device(const RunConfig& cfg, const DeviceMesh& mesh) {
  const auto split =
      split_tokens(ByteTokenizer().encode(default_corpus().substr(0, 20000)), 0.1, cfg.seq_len);
  const BatchSampler batches(&split.train, cfg.batch_size, cfg.seq_len, cfg.seed, kTrainStream);
  const BatchSampler val(&split.val, cfg.batch_size, cfg.seq_len, cfg.seed, kValStream);
  Trainer tp(cfg, mesh);
  RunConfig one_cfg = cfg;
  one_cfg.world_size = one_cfg.dp = one_cfg.tp = 1;
  one_cfg.fsdp = false;
  one_cfg.ac = "none";
  EXPECT_EQ(ac::is_checkpointed(tp.model().block(1)), cfg.ac != "none");
  Trainer one(one_cfg, std::nullopt);
  for (int64_t step = 0; step < cfg.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto a = tp.train_step(step, batches.get(step));
    const auto b = one.train_step(step, batches.get(step));
    EXPECT_NEAR(a.loss, b.loss, 1e-10 * b.loss);
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-9 * b.grad_norm);
    EXPECT_EQ(a.lr, b.lr);
  }
  EXPECT_NEAR(tp.evaluate(val, 2), one.evaluate(val, 2), 1e-10);
  // FSDP over TP: the spec of each TP parameter, to find this rank's tp-local part.
  std::map<std::string, DTensorSpec> tp_specs;
  if (cfg.fsdp && cfg.tp > 1) {
    models::Transformer probe(cfg.model);
    models::TensorParallelOptions o;
    o.sequence_parallel = cfg.sequence_parallel;
    o.loss_parallel = cfg.loss_parallel;
    models::apply_tensor_parallel(*probe, mesh["tp"], o);
    for (const auto& item : probe->named_parameters())
      tp_specs.emplace(item.key(), spec_of(item.value()));
  }
  auto tp_params = tp.model().named_parameters();
  auto one_params = one.model().named_parameters();
  ASSERT_EQ(tp_params.size(), one_params.size());
  for (const auto& item : one_params) {
    SCOPED_TRACE(item.key());
    const at::Tensor& p = tp_params[item.key()];
    if (cfg.fsdp) {  // this rank's rows (of its tp-local part), and the whole value
      ASSERT_TRUE(fsdp::is_fsdp_shard(p));
      at::Tensor full = item.value();
      if (auto it = tp_specs.find(item.key()); it != tp_specs.end())
        full = to_local(distribute_tensor(full, it->second.mesh(), it->second.placements()));
      EXPECT_TENSOR_CLOSE(local_tensor(p),
                          full.narrow(0, fsdp::shard_info(p).row_offset, local_tensor(p).size(0)),
                          1e-9, 1e-11);
      EXPECT_TENSOR_CLOSE(full_tensor(p), item.value(), 1e-9, 1e-11);
      continue;
    }
    // Without sequence parallelism the norm weights stay plain (the Megatron plan); every
    // rank then holds the whole weight and it still has to match.
    const bool plain = !cfg.sequence_parallel && item.key().find("norm") != std::string::npos;
    EXPECT_EQ(is_dtensor(p), !plain);
    EXPECT_TENSOR_CLOSE(is_dtensor(p) ? full_tensor(p) : p, item.value(), 1e-9, 1e-11);
  }
  // FSDP holds 1/dp of the parameters, gradients and AdamW state per rank (up to the uneven
  // last rows); TP a share of them.
  if (cfg.fsdp) {
    EXPECT_LE(static_cast<double>(tp.state_bytes_per_rank() * cfg.dp),
              1.1 * static_cast<double>(one.state_bytes_per_rank()));
  }
  EXPECT_LT(tp.state_bytes_per_rank(), one.state_bytes_per_rank());
  // The weights moved: a test that compares two untouched models would pass trivially.
  Trainer fresh(one_cfg, std::nullopt);
  EXPECT_FALSE(at::allclose(fresh.model().named_parameters()["layers.0.attention.wq.weight"],
                            one_params["layers.0.attention.wq.weight"]));
}

}  // namespace

TEST(TrainTrainer, TensorParallelStepsMatchOneDevice) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    for (bool sp : {true, false}) {
      for (bool lp : {true, false}) {
        SCOPED_TRACE(std::string("sequence_parallel=") + (sp ? "on" : "off") +
                     " loss_parallel=" + (lp ? "on" : "off"));
        expect_like_one_device(tiny_config(2, 1, sp, lp), mesh);
      }
    }
  });
}

// --ac full | selective: the same steps as one device without activation checkpointing.
TEST(TrainTrainer, ActivationCheckpointingStepsMatchOneDevice) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    for (const char* mode : {"full", "selective"}) {
      SCOPED_TRACE(mode);
      RunConfig cfg = tiny_config(2, 1, true, true);
      cfg.ac = mode;
      expect_like_one_device(cfg, mesh);
    }
  });
}

TEST(TrainTrainer, DataAndTensorParallelStepsMatchOneDevice) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    expect_like_one_device(tiny_config(4, 2, true, true), mesh);
  });
}

// --dp-shard 2 (FSDP, blocks resharded after forward), with and without activation
// checkpointing: the same steps as one device.
TEST(TrainTrainer, FullyShardedStepsMatchOneDevice) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    for (const char* mode : {"none", "full"}) {
      SCOPED_TRACE(mode);
      RunConfig cfg = tiny_config(2, 1, true, true, /*dp_shard=*/2);
      ASSERT_TRUE(cfg.fsdp);
      EXPECT_EQ(cfg.dp, 2);
      EXPECT_EQ(cfg.tp, 1);
      cfg.ac = mode;
      expect_like_one_device(cfg, mesh);
    }
  });
}

// --dp-shard 2 on 4 ranks: FSDP over TP=2 on a (dp, tp) mesh, the same steps as one device.
TEST(TrainTrainer, FullyShardedOverTensorParallelStepsMatchOneDevice) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    RunConfig cfg = tiny_config(4, 1, true, true, /*dp_shard=*/2);
    ASSERT_TRUE(cfg.fsdp);
    EXPECT_EQ(cfg.dp, 2);
    EXPECT_EQ(cfg.tp, 2);
    expect_like_one_device(cfg, mesh);
  });
}

// --dp-shard must divide the ranks and does not combine with --dp.
TEST(TrainTrainer, DpShardRefusesBadDegreesAndDp) {
  EXPECT_THROW(
      {
        try {
          tiny_config(4, 1, true, true, /*dp_shard=*/3);
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("dp_shard=3 does not divide the 4 ranks"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      std::invalid_argument);
  EXPECT_THROW(tiny_config(4, 2, true, true, /*dp_shard=*/4), std::invalid_argument);
}

// ---- --pp: pipeline stages (with TP inside them) ----

namespace {

RunConfig pipeline_config(int64_t world, int64_t pp, const std::string& schedule,
                          int64_t microbatches, bool tie = false, int64_t layers = 2) {
  TrainOptions o;
  o.preset = "tiny";
  o.steps = 3;
  o.batch_size = 4;
  o.seq_len = 32;
  o.layers = layers;
  o.warmup = 1;
  o.dtype = "float64";
  o.pp = pp;
  o.schedule = schedule;
  o.microbatches = microbatches;
  RunConfig c = resolve_run_config(o, world);
  c.model.tie_embeddings = tie;
  return c;
}

DeviceMesh pp_mesh(const RunConfig& cfg) {
  return init_device_mesh("cpu", {cfg.pp, cfg.tp}, {"pp", "tp"});
}

struct Data {
  TokenSplit split;
  std::unique_ptr<BatchSampler> train, val;
  explicit Data(const RunConfig& cfg)
      : split(split_tokens(ByteTokenizer().encode(default_corpus().substr(0, 20000)), 0.1,
                           cfg.seq_len)),
        train(std::make_unique<BatchSampler>(&split.train, cfg.batch_size, cfg.seq_len, cfg.seed,
                                             kTrainStream)),
        val(std::make_unique<BatchSampler>(&split.val, cfg.batch_size, cfg.seq_len, cfg.seed,
                                           kValStream)) {}
};

// Every parameter of the whole model (gathered from the stages under --pp, from the shards
// under --dp-shard) against `one`'s.
void expect_parameters_like(Trainer& t, Trainer& one, double rtol = 1e-9) {
  std::optional<Trainer> gathered, gathered_one;
  if (t.pipelined()) gathered.emplace(t.gather_to_one_device());
  if (one.pipelined()) gathered_one.emplace(one.gather_to_one_device());
  auto params = (gathered ? gathered->model() : t.model()).named_parameters();
  auto reference = (gathered_one ? gathered_one->model() : one.model()).named_parameters();
  ASSERT_EQ(params.size(), reference.size());
  for (const auto& item : reference) {
    SCOPED_TRACE(item.key());
    const at::Tensor& p = params[item.key()];
    at::Tensor whole = is_dtensor(p) ? full_tensor(p) : p;  // FSDP's leaves are DTensors
    EXPECT_TENSOR_CLOSE(whole, item.value(), rtol, 1e-11);
  }
}

// Resumes the step-2 checkpoint in `ckpt_dir` at `cfg`'s layout and checks step 3 against the
// continued run's loss and gradient norm and against one device that never saved (parameters
// after step 3, so the optimizer state must be right).
void expect_resume_continues(const std::string& ckpt_dir, const RunConfig& cfg,
                             std::optional<DeviceMesh> mesh, double loss, double grad_norm) {
  const Data data(cfg);
  checkpoint::CheckpointManager manager(ckpt_dir, 2);
  Trainer t(cfg, std::move(mesh));
  EXPECT_EQ(resume_training("auto", manager, t).step, 2);
  const StepStats s = t.train_step(2, data.train->get(2));
  EXPECT_NEAR(s.loss, loss, 1e-10 * loss);
  EXPECT_NEAR(s.grad_norm, grad_norm, 1e-9 * grad_norm);
  Trainer one(one_device(cfg), std::nullopt);
  for (int64_t step = 0; step < 3; ++step) one.train_step(step, data.train->get(step));
  expect_parameters_like(t, one);
}

// cfg.steps steps of the pipelined Trainer against one device: loss, gradient norm, validation
// loss and every parameter afterwards; the measured bubble is a share.
void expect_pipeline_like_one_device(const RunConfig& cfg) {
  const Data data(cfg);
  Trainer pp(cfg, pp_mesh(cfg));
  ASSERT_TRUE(pp.pipelined());
  Trainer one(one_device(cfg), std::nullopt);
  for (int64_t step = 0; step < cfg.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto a = pp.train_step(step, data.train->get(step));
    const auto b = one.train_step(step, data.train->get(step));
    EXPECT_NEAR(a.loss, b.loss, 1e-10 * b.loss);
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-9 * b.grad_norm);
    EXPECT_GE(a.bubble, 0);
    EXPECT_LT(a.bubble, 1);
    EXPECT_TRUE(std::isnan(b.bubble));
  }
  EXPECT_NEAR(pp.evaluate(*data.val, 2), one.evaluate(*data.val, 2), 1e-10);
  expect_parameters_like(pp, one);
  // The weights moved: comparing two untouched models would pass trivially.
  Trainer fresh(one_device(cfg), std::nullopt);
  EXPECT_FALSE(at::allclose(fresh.model().named_parameters()["layers.0.attention.wq.weight"],
                            one.model().named_parameters()["layers.0.attention.wq.weight"]));
}

}  // namespace

// --pp 2: both schedules, 1, 2 and 4 micro-batches, tied and untied embeddings.
TEST(TrainTrainer, PipelineStepsMatchOneDevice) {
  run_ranks(2, [](int) {
    for (const char* schedule : {"gpipe", "1f1b"}) {
      for (int64_t m : {1, 2, 4}) {
        for (bool tie : {false, true}) {
          SCOPED_TRACE(std::string(schedule) + " M=" + std::to_string(m) +
                       (tie ? " tied" : " untied"));
          const RunConfig cfg = pipeline_config(2, 2, schedule, m, tie);
          EXPECT_EQ(cfg.tp, 1);
          expect_pipeline_like_one_device(cfg);
        }
      }
    }
  });
}

// --pp 2 on 4 ranks: TP=2 inside each stage (loss parallel, no sequence parallelism); and
// --pp 4 with 4 blocks.
TEST(TrainTrainer, PipelineWithTensorParallelStagesMatchesOneDevice) {
  run_ranks(4, [](int) {
    for (const char* schedule : {"gpipe", "1f1b"}) {
      SCOPED_TRACE(schedule);
      const RunConfig cfg = pipeline_config(4, 2, schedule, 2, /*tie=*/true);
      EXPECT_EQ(cfg.tp, 2);
      EXPECT_FALSE(cfg.sequence_parallel);
      expect_pipeline_like_one_device(cfg);
    }
    SCOPED_TRACE("pp=4");
    expect_pipeline_like_one_device(pipeline_config(4, 4, "1f1b", 4, false, /*layers=*/4));
  });
}

// A checkpoint saved by a pipelined run at (pp=2, tp=1) after 2 steps holds the whole model
// under its own names: it loads at (pp=2, tp=1), (pp=1, tp=2), (pp=2, tp=2) and on one device,
// optimizer state included, and step 3 then gives what continuing without the save and load
// gives (the same numbers at the same layout; within float64 rounding at the others).
TEST(TrainTrainer, PipelineCheckpointsLoadAcrossLayouts) {
  TempDir dir;
  const std::string ckpt_dir = dir.file("checkpoints");
  const std::string continued = dir.file("continued.txt");
  run_ranks(2, [&](int rank) {
    const RunConfig cfg = pipeline_config(2, 2, "1f1b", 2, /*tie=*/true);
    const Data data(cfg);
    checkpoint::CheckpointManager manager(ckpt_dir, 2);
    Trainer a(cfg, pp_mesh(cfg));
    for (int64_t step = 0; step < 2; ++step) a.train_step(step, data.train->get(step));
    const std::string path = save_training_checkpoint(manager, a, 2, cfg.to_json());
    const StepStats next = a.train_step(2, data.train->get(2));
    if (rank == 0)
      std::ofstream(continued) << std::setprecision(17) << next.loss << ' ' << next.grad_norm;
    // Names are the whole model's: every block under its global index.
    const auto meta = checkpoint::read_checkpoint_metadata(path);
    EXPECT_EQ(meta.entries.at("pipeline_stages"), "2");
    Trainer b(cfg, pp_mesh(cfg));
    EXPECT_EQ(resume_training("auto", manager, b).step, 2);
    const StepStats again = b.train_step(2, data.train->get(2));
    EXPECT_EQ(again.loss, next.loss);
    EXPECT_EQ(again.grad_norm, next.grad_norm);
    expect_parameters_like(b, a, 0);
  });
  ASSERT_TRUE(std::filesystem::exists(ckpt_dir + "/step_000002.safetensors"));
  double loss = 0, grad_norm = 0;
  std::ifstream(continued) >> loss >> grad_norm;
  ASSERT_GT(loss, 0);

  auto resume_and_check = [&](const RunConfig& cfg, std::optional<DeviceMesh> mesh) {
    expect_resume_continues(ckpt_dir, cfg, std::move(mesh), loss, grad_norm);
  };
  run_ranks(2, [&](int) {
    SCOPED_TRACE("pp=1 tp=2");
    RunConfig cfg = one_device(pipeline_config(2, 2, "1f1b", 2, true));
    cfg.world_size = cfg.tp = 2;
    cfg.sequence_parallel = true;
    resume_and_check(cfg, init_device_mesh("cpu", {2}, {"tp"}));
  });
  run_ranks(4, [&](int) {
    SCOPED_TRACE("pp=2 tp=2");
    const RunConfig cfg = pipeline_config(4, 2, "gpipe", 4, true);
    resume_and_check(cfg, pp_mesh(cfg));
  });
  run_ranks(1, [&](int) {
    SCOPED_TRACE("one device");
    resume_and_check(one_device(pipeline_config(2, 2, "1f1b", 2, true)), std::nullopt);
  });
}

// A run saved at (pp, dp, tp) = (2, 2, 2) (FSDP shards inside pipeline stages, TP inside the
// shards) resumes at (1, 2, 4), (4, 1, 2), (1, 8, 1) and on one device, AdamW state included:
// the next step's loss and gradient norm are the continued run's, and every parameter after it
// is one device's that never saved.
TEST(TrainTrainer, ThreeDimensionalCheckpointResumesAtOtherLayouts) {
  TempDir dir;
  const std::string ckpt_dir = dir.file("checkpoints");
  const std::string continued = dir.file("continued.txt");
  // 4 blocks (pp = 4 needs one per stage), 8 sequences (dp = 8 needs one per rank).
  auto layout = [](int64_t pp, int64_t dp_shard, int64_t world) {
    TrainOptions o;
    o.preset = "tiny";
    o.steps = 3;
    o.batch_size = 8;
    o.seq_len = 16;
    o.layers = 4;
    o.warmup = 1;
    o.dtype = "float64";
    o.pp = pp;
    o.dp_shard = dp_shard;
    if (pp > 1) {
      o.schedule = "1f1b";
      o.microbatches = 2;
    }
    return resolve_run_config(o, world);
  };
  run_ranks(8, [&](int rank) {
    const RunConfig cfg = layout(2, 2, 8);
    ASSERT_EQ(cfg.tp, 2);
    const Data data(cfg);
    checkpoint::CheckpointManager manager(ckpt_dir, 2);
    Trainer a(cfg, make_train_mesh(cfg));
    for (int64_t step = 0; step < 2; ++step) a.train_step(step, data.train->get(step));
    save_training_checkpoint(manager, a, 2, cfg.to_json());
    const StepStats next = a.train_step(2, data.train->get(2));
    if (rank == 0)
      std::ofstream(continued) << std::setprecision(17) << next.loss << ' ' << next.grad_norm;
  });
  double loss = 0, grad_norm = 0;
  std::ifstream(continued) >> loss >> grad_norm;
  ASSERT_GT(loss, 0);
  auto resume_and_check = [&](const RunConfig& cfg, std::optional<DeviceMesh> mesh) {
    expect_resume_continues(ckpt_dir, cfg, std::move(mesh), loss, grad_norm);
  };
  for (const auto& [pp, dp_shard] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {4, 1}, {1, 8}}) {
    run_ranks(8, [&, pp = pp, dp_shard = dp_shard](int) {
      const RunConfig cfg = layout(pp, dp_shard, 8);
      SCOPED_TRACE("(pp, dp, tp) = (" + std::to_string(cfg.pp) + ", " + std::to_string(cfg.dp) +
                   ", " + std::to_string(cfg.tp) + ")");
      resume_and_check(cfg, make_train_mesh(cfg));
    });
  }
  run_ranks(1, [&](int) {
    SCOPED_TRACE("one device");
    resume_and_check(one_device(layout(2, 2, 8)), std::nullopt);
  });
}

// --mixed-precision bf16 with --dp-shard 2: the parameters and AdamW state stay float32, and
// the losses stay within bfloat16's tolerance of the float32 FSDP run (see
// FullyShard.MixedPrecisionBf16GathersHalfTheBytesAndStaysNearFloat32 for why 1%).
TEST(TrainTrainer, MixedPrecisionBf16StaysNearFloat32) {
  TrainOptions o;
  o.preset = "tiny";
  o.steps = 4;
  o.batch_size = 4;
  o.seq_len = 32;
  o.warmup = 1;
  o.dp_shard = 2;
  o.mixed_precision = "bf16";
  const RunConfig bf16 = resolve_run_config(o, 2);
  EXPECT_TRUE(bf16.bf16);
  EXPECT_EQ(bf16.verify_rtol, 1e-2);
  o.mixed_precision = "none";
  const RunConfig fp32 = resolve_run_config(o, 2);
  EXPECT_FALSE(fp32.bf16);
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 1}, {"dp", "tp"});
    const auto split =
        split_tokens(ByteTokenizer().encode(default_corpus().substr(0, 20000)), 0.1, 32);
    const BatchSampler batches(&split.train, 4, 32, fp32.seed, kTrainStream);
    Trainer a(bf16, mesh), b(fp32, mesh);
    for (int64_t step = 0; step < 4; ++step) {
      const auto sa = a.train_step(step, batches.get(step));
      const auto sb = b.train_step(step, batches.get(step));
      EXPECT_NEAR(sa.loss, sb.loss, 1e-2 * sb.loss) << "step " << step;
      EXPECT_NE(sa.loss, sb.loss) << "step " << step << ": bf16 changed nothing";
    }
    for (const auto& p : a.model().parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  });
  // Only with FSDP, on float32 parameters.
  o.mixed_precision = "bf16";
  o.dp_shard = 1;
  EXPECT_THROW(resolve_run_config(o, 2), std::invalid_argument);
  o.dp_shard = 2;
  o.dtype = "float64";
  EXPECT_THROW(resolve_run_config(o, 2), std::invalid_argument);
}

namespace {

// A (pp, dp_shard, tp) layout of dtensor_train.
struct Layout {
  int pp = 1, dp_shard = 1, tp = 1;
  bool ac = false;  // --ac full: every block recomputes its forward (and dropout mask) in backward
  int world() const { return pp * dp_shard * tp; }
  std::string name() const {
    return "pp" + std::to_string(pp) + "_dp" + std::to_string(dp_shard) + "_tp" +
           std::to_string(tp) + (ac ? "_ac" : "");
  }
};

// --layout-invariant `invariant` (0: off) at `layout`: five clipped AdamW steps with residual
// dropout of the tiny preset widened to 64 with 4 KV heads (every column shard 16 wide or more
// at TP 4, no KV head replicated), then a validation loss and a sampled continuation; rank 0
// writes what it saw, every parameter and its AdamW moments (a pipeline's gathered from its
// stages).
void layout_invariant_run(const Layout& layout, int64_t invariant, const std::string& file) {
  run_ranks(layout.world(), [&](int rank) {
    TrainOptions o;
    o.preset = "tiny";
    o.dim = 64;
    o.kv_heads = 4;
    o.steps = 5;
    o.batch_size = 2;
    o.seq_len = 16;
    o.warmup = 1;
    o.grad_clip = 0.5;  // below the first steps' norms: the scaling runs
    o.dropout = 0.1;
    o.sequence_parallel = false;  // what the mode runs; dropout needs it without the mode too
    o.layout_invariant = invariant;
    o.dp_shard = layout.dp_shard;
    o.pp = layout.pp;
    if (layout.ac) o.ac = "full";
    const RunConfig cfg = resolve_run_config(o, layout.world());
    Trainer t(cfg, make_train_mesh(cfg));
    const Data data(cfg);
    std::vector<double> losses, norms;
    for (int64_t step = 0; step < cfg.steps; ++step) {
      const StepStats s = t.train_step(step, data.train->get(step));
      losses.push_back(s.loss);
      norms.push_back(s.grad_norm);
    }
    std::map<std::string, at::Tensor> out;
    out["losses"] = at::tensor(losses, at::kDouble);
    out["grad_norms"] = at::tensor(norms, at::kDouble);
    out["val_loss"] = at::tensor({t.evaluate(*data.val, 2)}, at::kDouble);
    const std::vector<int64_t> prompt = {72, 101, 108, 108, 111};
    out["sample"] = at::tensor(t.generate(prompt, 8, 0.8, 7), at::kLong);
    std::optional<Trainer> whole;
    if (layout.pp > 1) whole.emplace(t.gather_to_one_device());
    Trainer& all = whole ? *whole : t;
    auto global = [](const at::Tensor& x) {
      return is_dtensor(x) ? full_tensor(x.detach()) : x.detach().clone();
    };
    for (const auto& p : all.model().named_parameters()) {
      out["param." + p.key()] = global(p.value());
      // AdamW's moments: every step's (clipped) gradient, averaged.
      const auto& state = static_cast<const torch::optim::AdamWParamState&>(
          *all.optimizer().state().at(p.value().unsafeGetTensorImpl()));
      out["exp_avg." + p.key()] = global(state.exp_avg());
      out["exp_avg_sq." + p.key()] = global(state.exp_avg_sq());
    }
    if (rank == 0) checkpoint::safetensors::save_file(out, file);
  });
}

// Whether `a` and `b` hold the same tensors, byte for byte.
::testing::AssertionResult same_bits(const std::map<std::string, at::Tensor>& a,
                                     const std::map<std::string, at::Tensor>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "different tensor lists";
  for (const auto& [name, t] : b) {
    const auto it = a.find(name);
    if (it == a.end()) return ::testing::AssertionFailure() << name << " missing";
    const at::Tensor& u = it->second;
    if (u.sizes() != t.sizes() || u.scalar_type() != t.scalar_type() ||
        std::memcmp(u.const_data_ptr(), t.const_data_ptr(), t.nbytes()) != 0)
      return ::testing::AssertionFailure() << name << " differs";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

// dtensor_train --layout-invariant 4: runs at (pp, dp_shard, tp) = (1, 1, 1) (TP on a one-rank
// mesh), (1, 1, 2), (1, 1, 4), (1, 2, 1), (1, 2, 2), (2, 1, 1), (2, 1, 2) (with activation
// checkpointing too) and (2, 2, 2) agree bit for bit in losses, gradient norms, the validation
// loss, the sampled text, every parameter and its AdamW moments. Without the mode TP 2, FSDP 2 and
// PP 2 end elsewhere than one rank.
TEST(TrainTrainer, LayoutInvariantRunsHaveTheSameBitsAtTpDpShardAndPpLayouts) {
  TempDir dir;
  auto file = [&](const Layout& l, int64_t invariant) {
    return (dir.path() / (l.name() + "_" + std::to_string(invariant) + ".safetensors")).string();
  };
  const std::vector<Layout> layouts = {{1, 1, 1}, {1, 1, 2}, {1, 1, 4},       {1, 2, 1}, {1, 2, 2},
                                       {2, 1, 1}, {2, 1, 2}, {2, 1, 2, true}, {2, 2, 2}};
  for (const Layout& l : layouts) layout_invariant_run(l, 4, file(l, 4));
  const auto one = checkpoint::safetensors::load_file(file(layouts[0], 4));
  for (const Layout& l : layouts)
    EXPECT_TRUE(same_bits(checkpoint::safetensors::load_file(file(l, 4)), one)) << l.name();
  const std::vector<Layout> plain_layouts = {{1, 1, 1}, {1, 1, 2}, {1, 2, 1}, {2, 1, 1}};
  for (const Layout& l : plain_layouts) layout_invariant_run(l, 0, file(l, 0));
  const auto plain = checkpoint::safetensors::load_file(file(plain_layouts[0], 0));
  for (size_t k = 1; k < plain_layouts.size(); ++k)
    EXPECT_FALSE(same_bits(checkpoint::safetensors::load_file(file(plain_layouts[k], 0)), plain))
        << "without the mode " << plain_layouts[k].name()
        << " and one rank should differ in the last bits";
}

TEST(TrainTrainer, LayoutInvariantRefusesWhatItDoesNotCover) {
  auto refusal = [](int64_t world, auto&& set) {
    TrainOptions o;
    o.preset = "tiny";
    o.dim = 64;
    o.kv_heads = 4;
    o.layout_invariant = 4;
    set(o);
    try {
      resolve_run_config(o, world);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_CONTAINS(refusal(2, [](TrainOptions& o) { o.layout_invariant = 3; }), "a power of two");
  EXPECT_CONTAINS(refusal(4, [](TrainOptions& o) { o.dp_shard = 4; }),
                  "covers FSDP (dp_shard) up to 2 ranks");
  EXPECT_CONTAINS(refusal(4, [](TrainOptions& o) { o.dp = 2; }),
                  "plain data parallelism's all-reduce (dp_replicate=2) is not canonical yet");
  EXPECT_CONTAINS(refusal(4,
                          [](TrainOptions& o) {
                            o.pp = 2;
                            o.microbatches = 4;
                          }),
                  "microbatches must be 2, not 4");
  EXPECT_CONTAINS(refusal(4,
                          [](TrainOptions& o) {
                            o.pp = 2;
                            o.layers = 4;
                            o.schedule = "interleaved";
                          }),
                  "not interleaved");
  EXPECT_EQ(refusal(4, [](TrainOptions& o) { o.pp = 2; }), "(accepted)");
  EXPECT_CONTAINS(refusal(4, [](TrainOptions& o) { o.layout_invariant = 2; }),
                  "the TP degree 4 must divide P");
  EXPECT_CONTAINS(refusal(2, [](TrainOptions& o) { o.overlap_comm = true; }),
                  "does not combine with overlap_comm");
  EXPECT_CONTAINS(refusal(4, [](TrainOptions& o) { o.kv_heads = 2; }),
                  "at tp=4: the model's 2 KV heads are replicated over the TP ranks");
  EXPECT_CONTAINS(refusal(4, [](TrainOptions& o) { o.dim = 32; }),
                  "at tp=4: the wq projection's column shards are 8 wide; the mode needs 16");
  EXPECT_EQ(refusal(4, [](TrainOptions&) {}), "(accepted)");
  EXPECT_EQ(refusal(4, [](TrainOptions& o) { o.dp_shard = 2; }), "(accepted)");
}
