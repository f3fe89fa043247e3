// dtensor_plan refuses every layout the trainer would refuse, or that would not fit, before it
// simulates anything, each with the fix; a valid layout's plan is consistent with the model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "common/run_config.h"
#include "dtensor/models/hf_checkpoint.h"
#include "plan/estimate.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/shell.h"
#include "support/temp_dir.h"

using namespace dtensor;

namespace {

plan::Layout layout(int64_t world, std::initializer_list<std::pair<std::string, int64_t>> kv,
                    std::optional<int64_t> tp = std::nullopt) {
  plan::Layout l;
  l.world_size = world;
  l.tp = tp;
  auto& o = l.options;
  o.preset = "tiny";
  o.layers = 4;
  o.batch_size = 8;
  for (const auto& [k, v] : kv) {
    if (k == "dp") o.dp = v;
    if (k == "dp_shard") o.dp_shard = v;
    if (k == "pp") o.pp = v;
    if (k == "microbatches") o.microbatches = v;
    if (k == "heads") o.heads = v;
    if (k == "kv_heads") o.kv_heads = v;
    if (k == "dim") o.dim = v;
    if (k == "layers") o.layers = v;
    if (k == "batch") o.batch_size = v;
    if (k == "seq") o.seq_len = v;
    if (k == "ffn") o.ffn_dim = v;
  }
  return l;
}

// The one refusal of `l`, which must mention every one of `words`.
void expect_refused(const plan::Layout& l, std::initializer_list<std::string> words,
                    const plan::Hardware& hw = {}) {
  const plan::Plan p = plan::make_plan(l, hw);
  ASSERT_EQ(p.refusals.size(), 1u);
  EXPECT_TRUE(p.ranks.empty() || !p.refusals.empty());
  for (const auto& w : words)
    EXPECT_NE(p.refusals[0].find(w), std::string::npos)
        << "refusal '" << p.refusals[0] << "' does not mention '" << w << "'";
}

}  // namespace

TEST(PlanValidity, HeadsNotDivisibleByTp) {
  expect_refused(layout(3, {}), {"n_heads=4 is not divisible by tp=3", "valid tp degrees"});
}

TEST(PlanValidity, FfnNotDivisibleByTp) {
  expect_refused(layout(4, {{"ffn", 30}}), {"the FFN hidden size 30 is not divisible by tp=4"});
}

TEST(PlanValidity, WorldIsNotTheProductOfTheDegrees) {
  expect_refused(layout(6, {{"dp_shard", 2}}, 2), {"--world-size is 6", "--tp 3"});
  expect_refused(layout(6, {{"pp", 4}}), {"pp=4 does not divide the 6 ranks"});
}

TEST(PlanValidity, MoreStagesThanLayers) {
  expect_refused(layout(8, {{"pp", 8}, {"layers", 4}, {"microbatches", 8}}),
                 {"at least one block per stage", "4 layers"});
}

// Pipeline stages with FSDP inside them are a layout, and so are stages replicated over dp.
TEST(PlanValidity, PipelineWithPlainDataParallelIsALayout) {
  const plan::Plan p = plan::make_plan(layout(4, {{"pp", 2}, {"dp", 2}}), {});
  EXPECT_TRUE(p.refusals.empty()) << p.refusals[0];
  EXPECT_FALSE(p.ranks.empty());
}

TEST(PlanValidity, PipelineWithFsdpIsAValidLayout) {
  const plan::Plan p = plan::make_plan(layout(8, {{"pp", 2}, {"dp_shard", 2}}), {});
  EXPECT_TRUE(p.refusals.empty()) << p.refusals[0];
  EXPECT_EQ(p.ranks.size(), 2u);  // one rank per stage
}

// It used to fail on the meta device: at::rms_norm's copy back to bfloat16 names the meta
// device, which bypassed the DTensor, and the attention got a doubled sequence.
TEST(PlanValidity, BFloat16FsdpOverSequenceParallelTpPlans) {
  auto l = layout(4, {{"dp_shard", 2}}, 2);
  l.options.mixed_precision = "bf16";
  const plan::Plan p = plan::make_plan(l, {});
  EXPECT_TRUE(p.refusals.empty()) << p.refusals[0];
  EXPECT_EQ(p.ranks.size(), 1u);
}

// An error the library raises while simulating reaches the user as its message alone. A TP plan
// (dtensor_train --plan) whose attention output comes back whole while the residual stream stays
// sequence-sharded passes every check made before simulating; the library's own error at the first
// residual add refuses it.
TEST(PlanValidity, ALibraryErrorWhileSimulatingIsRefusedWithoutAStackTrace) {
  std::ifstream in(std::string(DTENSOR_TRAIN_PLANS) + "/llama_tp.json");
  std::string plan_text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string wo =
      R"x("layers.*.attention.wo": "RowwiseParallel(input_layouts=(Shard(dim=-1),), )x"
      R"x(output_layouts=(Shard(dim=1),), use_local_output=True)")x";
  const auto at = plan_text.find(wo);
  ASSERT_NE(at, std::string::npos) << "the built-in plan no longer has " << wo;
  plan_text.replace(at, wo.size(), R"x("layers.*.attention.wo": "RowwiseParallel()")x");
  dtensor::testing::TempDir dir;
  const std::string path = dir.file("whole_attention_output.json");
  std::ofstream(path) << plan_text;
  auto l = layout(2, {}, 2);
  l.options.plan_path = path;
  const plan::Plan p = plan::make_plan(l, {});
  ASSERT_EQ(p.refusals.size(), 1u);
  EXPECT_NE(p.refusals[0].find("the library refused this layout while simulating rank 0"),
            std::string::npos)
      << p.refusals[0];
  EXPECT_EQ(p.refusals[0].find("Exception raised from"), std::string::npos) << p.refusals[0];
  EXPECT_EQ(p.refusals[0].find("frame #"), std::string::npos) << p.refusals[0];
  // The same from the command line: dtensor_plan --plan, exit status 3 (refused).
  const auto r = dtensor::testing::shell(std::string(DTENSOR_PLAN_PATH) +
                                         " --preset tiny --world-size 2 --plan " + path);
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("refused: the library refused this layout while simulating rank 0"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
}

// Every rule of combining the parallelisms with the model and the batch is the library's
// (models::ParallelDims::validate): dtensor_plan refuses a layout in the words dtensor_train
// refuses it with, one case per rule the trainer held before.
TEST(PlanValidity, RefusesLayoutsInTheTrainersWords) {
  struct Case {
    const char* rule;
    int64_t world;
    std::function<void(train::TrainOptions&)> set;
    const char* words;
  };
  const std::vector<Case> cases = {
      {"heads over tp", 3, [](train::TrainOptions&) {}, "n_heads=4 is not divisible by tp=3"},
      {"sequence over tp", 4, [](train::TrainOptions& o) { o.seq_len = 30; },
       "sequence length 30 is not divisible by tp=4"},
      {"dropout under sequence parallelism", 2, [](train::TrainOptions& o) { o.dropout = 0.1; },
       "residual dropout keys its masks by whole sequences"},
      {"overlap without sequence parallelism", 2,
       [](train::TrainOptions& o) {
         o.overlap_comm = true;
         o.sequence_parallel = false;
       },
       "overlap_comm overlaps the built-in plan's sequence-parallel"},
      {"overlap in pipeline stages", 2,
       [](train::TrainOptions& o) {
         o.pp = 2;
         o.overlap_comm = true;
       },
       "overlap_comm does not apply to pipeline parallelism (pp=2)"},
      {"blocks per stage", 8,
       [](train::TrainOptions& o) {
         o.pp = 8;
         o.microbatches = 8;
       },
       "needs at least one block per stage, but the model has 4 layers for 8 stages"},
      {"micro-batches", 2,
       [](train::TrainOptions& o) {
         o.pp = 2;
         o.microbatches = 3;
       },
       "the batch of 8 rows does not split into microbatches=3 equal micro-batches"},
      {"interleaved rounds", 2,
       [](train::TrainOptions& o) {
         o.pp = 2;
         o.schedule = "interleaved";
         o.batch_size = 10;
         o.microbatches = 5;
       },
       "use microbatches a multiple of 2 or below 4"},
      {"batch over dp", 4,
       [](train::TrainOptions& o) {
         o.dp_shard = 4;
         o.batch_size = 6;
       },
       "the batch of 6 rows does not split over dp=4 data-parallel ranks"},
      {"dp with dp_shard", 4,
       [](train::TrainOptions& o) {
         o.dp = 2;
         o.dp_shard = 2;
       },
       "(HSDP: replicas of FSDP groups) is not built yet"},
      {"mixed precision without FSDP", 2,
       [](train::TrainOptions& o) { o.mixed_precision = "bf16"; },
       "mixed precision (fsdp.param_dtype) is FSDP's"},
      {"mixed precision in float64", 2,
       [](train::TrainOptions& o) {
         o.dp_shard = 2;
         o.mixed_precision = "bf16";
         o.dtype = "float64";
       },
       "FSDP's mixed precision keeps float32 parameters"},
      {"layout-invariant segments", 2, [](train::TrainOptions& o) { o.layout_invariant = 3; },
       "the layout-invariant mode (P=3): P is the number of canonical segments"},
      {"layout-invariant with dp", 2,
       [](train::TrainOptions& o) {
         o.layout_invariant = 4;
         o.dp = 2;
       },
       "plain data parallelism's all-reduce (dp_replicate=2) is not canonical yet"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.rule);
    plan::Layout l = layout(c.world, {});
    c.set(l.options);
    std::string trainer = "(accepted)";
    try {
      train::resolve_run_config(l.options, c.world);
    } catch (const std::exception& e) {
      trainer = e.what();
    }
    EXPECT_CONTAINS(trainer, c.words);
    const plan::Plan p = plan::make_plan(l, {});
    ASSERT_EQ(p.refusals.size(), 1u);
    EXPECT_EQ(p.refusals[0], trainer);
  }
}

namespace {

// The message of the line of `output` that starts with `prefix` ("" when there is none).
std::string line_after(const std::string& output, const std::string& prefix) {
  for (size_t at = 0; at < output.size();) {
    const size_t end = std::min(output.find('\n', at), output.size());
    const std::string line = output.substr(at, end - at);
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
    at = end + 1;
  }
  return "";
}

}  // namespace

// The same from the command lines: dtensor_train, alone as rank 0 of WORLD_SIZE ranks (it
// refuses before meeting the others), and dtensor_plan --world-size print the one message
// ParallelDims::validate gives, for each rule both programs' flags reach (--dropout,
// --overlap-comm and --layout-invariant are the trainer's alone: the test above has them).
TEST(PlanValidity, TrainAndPlanProgramsPrintTheSameRefusal) {
  dtensor::testing::TempDir dir;
  models::DecoderConfig model = models::DecoderConfig::preset("tiny");
  model.n_layers = 4;
  const std::string config = dir.file("tiny_4_layers.json");
  std::ofstream(config) << model.to_json();
  const std::string plan_file = std::string(DTENSOR_TRAIN_PLANS) + "/llama_tp.json";
  struct Case {
    const char* rule;
    int64_t world;
    int64_t batch;
    std::string flags;  // spelled alike by both programs
    const char* words;
  };
  const std::vector<Case> cases = {
      {"degrees over the world", 6, 8, "--pp 4",
       "pp=4 does not divide the 6 ranks; tp (-1) is the ranks the others leave"},
      {"heads over tp", 3, 8, "", "n_heads=4 is not divisible by tp=3"},
      {"sequence over tp", 4, 8, "--seq-len 30", "sequence length 30 is not divisible by tp=4"},
      {"blocks per stage", 8, 8, "--pp 8 --microbatches 8",
       "needs at least one block per stage, but the model has 4 layers for 8 stages"},
      {"micro-batches", 2, 8, "--pp 2 --microbatches 3",
       "the batch of 8 rows does not split into microbatches=3 equal micro-batches"},
      {"interleaved rounds", 2, 10, "--pp 2 --schedule interleaved --microbatches 5",
       "use microbatches a multiple of 2 or below 4"},
      {"batch over dp", 4, 6, "--dp-shard 4",
       "the batch of 6 rows does not split over dp=4 data-parallel ranks"},
      {"dp with dp_shard", 4, 8, "--dp 2 --dp-shard 2",
       "(HSDP: replicas of FSDP groups) is not built yet"},
      {"mixed precision without FSDP", 2, 8, "--mixed-precision bf16",
       "mixed precision (fsdp.param_dtype) is FSDP's"},
      {"mixed precision in float64", 2, 8, "--dp-shard 2 --mixed-precision bf16 --dtype float64",
       "FSDP's mixed precision keeps float32 parameters"},
      {"a plan file in pipeline stages", 4, 8, "--pp 2 --plan " + plan_file,
       "a custom tensor-parallel plan (tp_plan) does not apply to pipeline parallelism (pp=2)"},
      {"a plan file with FSDP", 4, 8, "--dp-shard 2 --plan " + plan_file,
       "a custom tensor-parallel plan (tp_plan) does not combine with FSDP (dp_shard=2)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.rule);
    const std::string world = std::to_string(c.world), batch = std::to_string(c.batch);
    const auto train = dtensor::testing::shell("env WORLD_SIZE=" + world + " RANK=0 LOCAL_RANK=0 " +
                                               DTENSOR_TRAIN_PATH + " --config " + config +
                                               " --batch-size " + batch + " " + c.flags);
    EXPECT_EQ(train.exit_code, 2) << train.output;
    const auto plan =
        dtensor::testing::shell(std::string(DTENSOR_PLAN_PATH) + " --config " + config +
                                " --world-size " + world + " --batch " + batch + " " + c.flags);
    EXPECT_EQ(plan.exit_code, 3) << plan.output;
    const std::string said = line_after(train.output, "dtensor_train: ");
    EXPECT_CONTAINS(said, c.words);
    EXPECT_EQ(line_after(plan.output, "  refused: "), said) << plan.output;
  }
}

TEST(PlanValidity, BatchDoesNotSplitIntoMicrobatches) {
  expect_refused(layout(2, {{"pp", 2}, {"microbatches", 3}}),
                 {"does not split into microbatches=3 equal micro-batches"});
}

TEST(PlanValidity, BatchNotDivisibleByDp) {
  expect_refused(layout(4, {{"dp_shard", 4}, {"batch", 6}}),
                 {"the batch of 6 rows does not split over dp=4 data-parallel ranks"});
}

TEST(PlanValidity, SequenceNotDivisibleForSequenceParallelism) {
  expect_refused(layout(4, {{"seq", 30}}), {"sequence length 30", "multiple of 4"});
}

TEST(PlanValidity, OverTheDeviceMemory) {
  plan::Hardware hw;
  hw.device_memory_gib = 1e-5;  // ~10 KiB: the tiny model's step does not fit
  expect_refused(layout(2, {}), {"over --device-memory", "--ac full"}, hw);
}

TEST(PlanValidity, KvHeadsNotDivisibleByTpIsAWarningNotARefusal) {
  const plan::Plan p = plan::make_plan(layout(4, {{"kv_heads", 2}}), {});
  EXPECT_TRUE(p.refusals.empty()) << p.refusals.front();
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_NE(p.warnings[0].find("n_kv_heads=2 is not divisible by tp=4"), std::string::npos);
}

TEST(PlanValidity, AValidPlanHasOneRankPerStageAndTheModelsParameters) {
  const plan::Plan p = plan::make_plan(layout(4, {{"pp", 2}, {"microbatches", 4}}), {});
  ASSERT_TRUE(p.refusals.empty()) << p.refusals.front();
  ASSERT_EQ(p.ranks.size(), 2u);
  EXPECT_EQ(p.ranks[0].sim.who.rank, 0);
  EXPECT_EQ(p.ranks[1].sim.who.rank, 2);
  // Per stage tp=2 shards; over both stages and both tp ranks the bytes are the model's,
  // minus the norms each tp rank keeps whole (replicated, counted twice).
  int64_t bytes = 0;
  for (const auto& r : p.ranks) bytes += r.sim.step.state.parameters;
  const int64_t whole = p.config.model.num_parameters() * 4;
  EXPECT_GT(bytes * 2, whole);
  EXPECT_LT(bytes * 2, whole * 11 / 10);
  EXPECT_LT(p.step_low_s, p.step_high_s);
  EXPECT_GT(p.step_low_s, 0);
}

TEST(PlanValidity, SplitsOfAWorld) {
  const auto s = plan::splits_of(8);
  EXPECT_EQ(s.size(), 10u);  // ordered triples of divisors with product 8
  for (auto [dp, tp, pp] : s) EXPECT_EQ(dp * tp * pp, 8);
}

TEST(PlanValidity, RingAlphaBeta) {
  plan::Hardware hw;
  hw.intra_gbps = 100;
  hw.intra_latency_us = 0;
  // all_gather of 1 GB per rank over 4: each rank receives 3 GB.
  EXPECT_NEAR(plan::collective_seconds("all_gather_into_tensor", 1'000'000'000, 4, true, hw), 0.03,
              1e-12);
  EXPECT_NEAR(plan::collective_seconds("all_reduce", 1'000'000'000, 4, true, hw), 0.015, 1e-12);
  EXPECT_EQ(plan::collective_seconds("send", 1'000'000'000, 2, true, hw), 0);
}

// A simulation leaves nothing behind for the next in the same process (--search and
// --compare-ac make several). Two things did. The thread's sharding-decision cache kept specs
// whose mesh, equal by shape, ranks and names to the new world's "tp" sub-mesh, carried the old
// world's group (mesh dim 2 of a 3-D mesh): a [pp, tp] plan after a [pp, dp_shard, tp] one
// recorded its TP all_reduces on mesh dim 2 and failed. And FSDP's last forward call, held
// weakly by the thread, kept its gathered storages: a second FSDP plan saw them freed during
// its own step and reported a peak 5% too low. In a fresh process, so that "alone" is alone.
TEST(PlanValidity, APlanAfterOtherLayoutsInOneProcessEqualsItsPlanAlone) {
  dtensor::testing::run_ranks(
      1,
      [](int) {
        const auto ledger_of = [](const plan::Plan& p) {
          std::vector<std::tuple<std::string, std::string, std::string, int64_t, int64_t>> rows;
          for (const auto& r : p.ranks)
            for (const auto& row : r.ledger)
              rows.emplace_back(row.op, row.dim, row.phase, row.count, row.bytes);
          return rows;
        };
        auto bf16 = layout(4, {{"dp_shard", 2}}, 2);
        bf16.options.mixed_precision = "bf16";
        const auto fsdp_tp = layout(4, {{"dp_shard", 2}}, 2);
        const auto pp_tp = layout(4, {{"pp", 2}, {"microbatches", 4}});
        std::vector<plan::Plan> alone;
        for (const auto& l : {fsdp_tp, pp_tp}) alone.push_back(plan::make_plan(l, {}));
        for (const auto& before :
             {bf16, layout(8, {{"pp", 2}, {"dp_shard", 2}}), layout(4, {{"kv_heads", 2}})}) {
          const plan::Plan first = plan::make_plan(before, {});
          ASSERT_TRUE(first.refusals.empty()) << first.refusals.front();
          size_t i = 0;
          for (const auto& l : {fsdp_tp, pp_tp}) {
            const plan::Plan again = plan::make_plan(l, {});
            ASSERT_TRUE(again.refusals.empty()) << again.refusals.front();
            EXPECT_EQ(ledger_of(again), ledger_of(alone[i]));
            EXPECT_EQ(again.peak_bytes, alone[i].peak_bytes);
            ++i;
          }
        }
      },
      {.init_process_group = false});
}

// --hf-config builds the run from the checkpoint's config as an object: the same plan as that
// config written to a --config file, and nothing written meanwhile (a temporary config file was
// left in TMPDIR when a usage error ended the run before).
TEST(PlanValidity, AHuggingFaceConfigPlansAsItsConfigFileAndWritesNoFile) {
  const std::string hf = std::string(DTENSOR_HF_FIXTURES) + "/family_models/qwen3";
  dtensor::testing::TempDir dir, tmp;
  const std::string config = dir.file("qwen3.json");
  std::ofstream(config) << models::read_hf_config(hf).config.to_json();
  const std::string plan = "env TMPDIR=" + tmp.path().string() + " " + DTENSOR_PLAN_PATH +
                           " --world-size 2 --seq-len 32 --progress none ";
  // Everything but the last line, the simulation's own wall time.
  auto without_timing = [](std::string text) { return text.substr(0, text.rfind("\nsimulated")); };
  const auto from_hf = dtensor::testing::shell(plan + "--hf-config " + hf);
  const auto from_file = dtensor::testing::shell(plan + "--config " + config);
  ASSERT_EQ(from_hf.exit_code, 0) << from_hf.output;
  ASSERT_EQ(from_file.exit_code, 0) << from_file.output;
  EXPECT_EQ(without_timing(from_hf.output), without_timing(from_file.output));
  const auto usage = dtensor::testing::shell("env TMPDIR=" + tmp.path().string() + " " +
                                             DTENSOR_PLAN_PATH + " --search --hf-config " + hf);
  EXPECT_EQ(usage.exit_code, 2) << usage.output;
  EXPECT_EQ(tmp.entries(), std::vector<std::string>{});
}
