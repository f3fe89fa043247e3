// dtensor_train checkpoints with FSDP (--dp-shard): a checkpoint holds the global tensors
// under their global names whatever the layout that saved it, so it loads at any other
// (dp_shard, tp) layout and on one device with the AdamW state, and the next step there is the
// step the saving layout takes.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/corpus.h"
#include "common/run_config.h"
#include "common/tokenizer.h"
#include "common/trainer.h"
#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/temp_dir.h"
#include "train/checkpoints.h"

using namespace dtensor;
using namespace dtensor::train;
using dtensor::testing::run_ranks;
using dtensor::testing::TempDir;

namespace {

constexpr int kRanks = 4;

// dp_shard x tp ranks; {0, 0}: one device with plain LibTorch.
struct Layout {
  int64_t dp_shard = 0;
  int64_t tp = 0;
  bool one_device() const { return tp == 0; }
  std::string name() const {
    return one_device() ? "one device"
                        : "dp_shard=" + std::to_string(dp_shard) + " tp=" + std::to_string(tp);
  }
};

RunConfig config_for(const Layout& l) {
  TrainOptions o;
  o.preset = "tiny";
  o.kv_heads = 4;  // whole kv heads on each of 4 TP ranks
  o.steps = 4;
  o.batch_size = 4;
  o.seq_len = 32;
  o.warmup = 1;
  o.dtype = "float64";  // differences then come from the code, not float32 rounding
  o.dp_shard = l.one_device() ? 1 : l.dp_shard;
  RunConfig cfg = resolve_run_config(o, l.one_device() ? 1 : kRanks);
  EXPECT_EQ(cfg.fsdp, l.dp_shard > 1);
  return cfg;
}

// The mesh dtensor_train builds for the layout (collective over all ranks).
std::optional<DeviceMesh> mesh_for(const Layout& l) {
  if (l.one_device()) return std::nullopt;
  if (l.dp_shard > 1) return init_device_mesh("cpu", {l.dp_shard, l.tp}, {"dp", "tp"});
  return init_device_mesh("cpu", {l.tp}, {"tp"});
}

Batch batch(const RunConfig& cfg, int64_t step) {
  static const auto split =
      split_tokens(ByteTokenizer().encode(default_corpus().substr(0, 20000)), 0.1, cfg.seq_len);
  const BatchSampler batches(&split.train, cfg.batch_size, cfg.seq_len, cfg.seed, kTrainStream);
  return batches.get(step);
}

std::string save(Trainer& t, const std::string& dir, int64_t step) {
  checkpoint::CheckpointManager manager(dir, /*keep_last=*/4);
  return save_training_checkpoint(manager, t, step, t.config().to_json());
}

// Every tensor of `b` is within `rtol` of `a`'s (relative to the tensor's largest entry;
// 0: bitwise equal, as are AdamW's step counts always), and the two hold the same names.
void expect_files_match(const std::string& a, const std::string& b, double rtol) {
  const auto ta = checkpoint::safetensors::load_file(a);
  const auto tb = checkpoint::safetensors::load_file(b);
  ASSERT_EQ(ta.size(), tb.size());
  for (const auto& [name, t] : ta) {
    SCOPED_TRACE(name);
    ASSERT_EQ(tb.count(name), 1u);
    if (rtol == 0 || t.dim() == 0) {
      EXPECT_TRUE(at::equal(tb.at(name), t));
      continue;
    }
    const double scale = t.abs().max().item<double>();
    EXPECT_LE((tb.at(name) - t).abs().max().item<double>(), rtol * scale);
  }
}

// Trains 2 steps at `from`, saves, takes step 2; loads the checkpoint at `to`, saves it again
// (the same file, bitwise: nothing is lost or reordered), takes step 2 and compares.
void expect_moves(const Layout& from, const Layout& to, const std::string& dir) {
  SCOPED_TRACE(from.name() + " -> " + to.name());
  const std::string tag = std::to_string(from.dp_shard) + std::to_string(from.tp) + "_" +
                          std::to_string(to.dp_shard) + std::to_string(to.tp);
  const RunConfig cfg_a = config_for(from);
  Trainer a(cfg_a, mesh_for(from));
  a.train_step(0, batch(cfg_a, 0));
  a.train_step(1, batch(cfg_a, 1));
  const std::string saved = save(a, dir + "/a" + tag, 2);
  const auto sa = a.train_step(2, batch(cfg_a, 2));
  const std::string after_a = save(a, dir + "/a" + tag, 3);

  const RunConfig cfg_b = config_for(to);
  Trainer b(cfg_b, mesh_for(to));
  checkpoint::CheckpointManager manager(dir + "/b" + tag, 4);
  EXPECT_EQ(resume_training(saved, manager, b).step, 2);
  // The global names of the model, not of a layout.
  const auto named = checkpoint::safetensors::load_file(saved);
  EXPECT_EQ(named.at("layers.0.attention.wq.weight").sizes(),
            (std::vector<int64_t>{cfg_a.model.dim, cfg_a.model.dim}));
  EXPECT_EQ(named.count("optim.state.layers.1.feed_forward.w2.weight.exp_avg_sq"), 1u);
  expect_files_match(saved, save(b, dir + "/b" + tag, 2), 0);
  const auto sb = b.train_step(2, batch(cfg_b, 2));
  EXPECT_NEAR(sb.loss, sa.loss, 1e-12 * sa.loss);
  EXPECT_NEAR(sb.grad_norm, sa.grad_norm, 1e-12 * sa.grad_norm);
  expect_files_match(after_a, save(b, dir + "/b" + tag, 3), 1e-12);
}

}  // namespace

// Saved at (dp_shard=2, tp=2), resumed at (1, 4), (4, 1) and on one device; and the reverse.
TEST(TrainFsdpCheckpoint, ResumesAtAnyLayoutWithTheSameNextStep) {
  TempDir dir;
  const std::string path = dir.path().string();
  run_ranks(kRanks, [&](int) {
    const Layout fsdp_tp{2, 2};
    for (const Layout& other : {Layout{1, 4}, Layout{4, 1}, Layout{}}) {
      expect_moves(fsdp_tp, other, path);
      expect_moves(other, fsdp_tp, path);
    }
  });
}

// dtensor_train takes the checkpoint options with --dp-shard (it refused them before).
TEST(TrainFsdpCheckpoint, DpShardTakesCheckpointOptions) {
  TrainOptions o;
  o.preset = "tiny";
  o.dp_shard = 2;
  o.ckpt_every = 2;
  o.final_ckpt = true;
  o.resume = "auto";
  const RunConfig cfg = resolve_run_config(o, 4);
  EXPECT_TRUE(cfg.fsdp);
  EXPECT_EQ(cfg.dp, 2);
  EXPECT_EQ(cfg.tp, 2);
}
