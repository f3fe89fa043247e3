// ParallelDims: the degrees of a run, the mesh they build and the roles read from any mesh, and
// validate(), which holds every rule of composing the parallelisms with a model and a run's
// options. One test per rule: each refuses what dtensor_train and dtensor_plan refused (they now
// print these words).
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "dtensor/dtensor.h"
#include "dtensor/models/parallel_dims.h"
#include "dtensor/models/parallelize.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

// The tiny preset (4 heads, 2 KV heads, dim 32, 2 layers, vocab 256, sequence 128).
DecoderConfig tiny() { return DecoderConfig::preset("tiny"); }

// Degrees over their product of ranks.
ParallelDims dims(int64_t pp, int64_t dp_replicate, int64_t dp_shard, int64_t tp) {
  ParallelDims d{.dp_replicate = dp_replicate, .dp_shard = dp_shard, .tp = tp, .pp = pp};
  d.world_size = pp * dp_replicate * dp_shard * tp;
  return d;
}

// The run's options as the trainer makes them from the dims: FSDP when dp_shard > 1.
TrainingOptions run_for(const ParallelDims& d, int64_t batch = 8, int64_t seq = 16) {
  TrainingOptions r;
  r.parallelize.fully_shard = d.dp_shard > 1;
  r.pipeline.microbatches = d.pp;
  r.batch_size = batch;
  r.seq_len = seq;
  return r;
}

void expect_refused(const ParallelDims& d, const DecoderConfig& model, const TrainingOptions& run,
                    std::initializer_list<std::string> words) {
  EXPECT_ERROR(d.validate(model, run), c10::Error, std::vector<std::string>(words));
}

}  // namespace

// ---- degrees ----

TEST(ParallelDims, ResolvedGivesTheRanksTheOthersLeave) {
  ParallelDims d{.dp_shard = 2, .tp = -1, .pp = 2, .world_size = 8};
  const ParallelDims r = d.resolved();
  EXPECT_EQ(r.tp, 2);
  EXPECT_EQ(r.dp(), 2);
  EXPECT_EQ(r.expert_fold(), 4);
  EXPECT_ERROR((ParallelDims{.tp = -1, .pp = 3, .world_size = 4}.resolved()), c10::Error,
               "pp=3 does not divide the 4 ranks; tp (-1) is the ranks the others leave");
  EXPECT_ERROR((ParallelDims{.dp_shard = -1, .tp = -1, .world_size = 4}.resolved()), c10::Error,
               "only one degree may be -1");
}

TEST(ParallelDims, DegreesMustMultiplyToTheWorld) {
  EXPECT_NO_THROW(dims(2, 1, 2, 2).validate());
  ParallelDims d = dims(2, 1, 2, 2);
  d.world_size = 4;
  EXPECT_ERROR(d.validate(), c10::Error, "pp=2 x dp_shard=2 x tp=2 = 8 ranks, but world_size is 4");
  d = dims(1, 1, 1, 0);
  EXPECT_ERROR(d.validate(), c10::Error, "tp must be at least 1, got 0");
}

TEST(ParallelDims, HsdpIsNotBuiltYet) {
  expect_refused(dims(1, 2, 2, 1), tiny(), run_for(dims(1, 2, 2, 1)),
                 {"dp_replicate=2 with dp_shard=2", "HSDP", "not built yet"});
}

TEST(ParallelDims, ContextParallelismComposesWithTensorParallelismAndFsdp) {
  EXPECT_NO_THROW((ParallelDims{.cp = 2, .tp = 2, .world_size = 4}.validate()));
  EXPECT_NO_THROW((ParallelDims{.dp_shard = 2, .cp = 2, .world_size = 4}.validate()));
  ParallelDims d{.dp_replicate = 2, .cp = 2, .world_size = 4};
  EXPECT_ERROR(d.validate(), c10::Error, "context parallelism (cp=2) with dp_replicate=2 x cp=2",
               "cp composes with tensor parallelism (tp) and FSDP (dp_shard)");
  d = ParallelDims{.cp = 2, .pp = 2, .world_size = 4};
  EXPECT_ERROR(d.validate(), c10::Error, "context parallelism (cp=2) with pp=2 x cp=2");
}

TEST(ParallelDimsValidate, ContextParallelismRefusesWhatItCannotRun) {
  const ParallelDims d{.cp = 4, .world_size = 4};
  EXPECT_NO_THROW(d.validate(tiny(), run_for(d, 8, 4)));
  expect_refused(d, tiny(), run_for(d, 8, 3), {"the sequence of 3 tokens is shorter than cp=4"});
  DecoderConfig m = tiny();
  m.attention_sinks = true;
  expect_refused(d, m, run_for(d), {"context parallelism (cp=4)", "attention sinks"});
  expect_refused(d, DecoderConfig::preset("tiny-moe"), run_for(d),
                 {"context parallelism (cp=4) with mixture-of-experts layers"});
  m = tiny();
  m.dropout = 0.1;
  expect_refused(d, m, run_for(d), {"residual dropout"});
}

// ep folds over dp_shard x cp x tp, as torchtitan's sparse mesh: it must divide them.
TEST(ParallelDims, ExpertParallelismFoldsOverTheDenseRanks) {
  ParallelDims d{.dp_shard = 2, .tp = 2, .ep = 3, .world_size = 4};
  EXPECT_ERROR(d.validate(), c10::Error,
               "expert parallelism (ep=3) folds over the dp_shard x cp x tp = 4 ranks",
               "must divide them");
  d.ep = 4;
  EXPECT_NO_THROW(d.validate());
}

// Before anything is built or loaded: the experts must divide by ep, a dense model has none, and
// the decoder's plan folds ep over the tp ranks only.
TEST(ParallelDimsValidate, ExpertsMustDivideByEpWhichFoldsOverTheTpRanks) {
  ParallelDims d = dims(1, 1, 1, 4);
  d.ep = 4;
  TrainingOptions run = run_for(d);
  run.parallelize.tp.ep = 4;
  DecoderConfig moe = DecoderConfig::preset("tiny-moe");
  moe.moe->options.num_experts = 6;
  expect_refused(d, moe, run, {"num_experts 6 is not divisible by ep=4"});
  expect_refused(d, tiny(), run, {"expert parallelism (ep=4) needs mixture-of-experts"});
  moe.moe->options.num_experts = 8;
  EXPECT_NO_THROW(d.validate(moe, run));
  d.ep = 2;
  run.parallelize.tp.ep = 2;
  expect_refused(d, moe, run,
                 {"expert parallelism (ep=2) folds over the tp ranks only yet", "must equal tp=4"});
  ParallelDims fsdp = dims(1, 1, 2, 2);
  fsdp.ep = 2;
  TrainingOptions fsdp_run = run_for(fsdp);
  fsdp_run.parallelize.tp.ep = 2;
  expect_refused(fsdp, moe, fsdp_run, {"(ep=2) with FSDP (dp_shard=2) is not built yet"});
}

// ---- tensor parallelism ----

TEST(ParallelDimsValidate, HeadsMustSplitOverTp) {
  expect_refused(dims(1, 1, 1, 3), tiny(), run_for(dims(1, 1, 1, 3)),
                 {"n_heads=4 is not divisible by tp=3", "valid tp degrees: 1, 2, 4"});
}

TEST(ParallelDimsValidate, SequenceParallelismNeedsTheSequenceToSplit) {
  expect_refused(dims(1, 1, 1, 4), tiny(), run_for(dims(1, 1, 1, 4), 8, 30),
                 {"sequence length 30 is not divisible by tp=4", "sequence_parallel=false"});
  TrainingOptions plain = run_for(dims(1, 1, 1, 4), 8, 30);
  plain.parallelize.tp.sequence_parallel = false;
  EXPECT_NO_THROW(dims(1, 1, 1, 4).validate(tiny(), plain));
}

TEST(ParallelDimsValidate, DropoutIsRefusedUnderSequenceParallelism) {
  DecoderConfig m = tiny();
  m.dropout = 0.1;
  expect_refused(dims(1, 1, 1, 2), m, run_for(dims(1, 1, 1, 2)),
                 {"residual dropout keys its masks by whole sequences", "sequence_parallel=false"});
  TrainingOptions plain = run_for(dims(1, 1, 1, 2));
  plain.parallelize.tp.sequence_parallel = false;
  EXPECT_NO_THROW(dims(1, 1, 1, 2).validate(m, plain));
}

TEST(ParallelDimsValidate, OverlapCommNeedsSequenceParallelismAndTheBuiltInPlan) {
  TrainingOptions r = run_for(dims(1, 1, 1, 2));
  r.parallelize.tp.overlap_comm = true;
  r.parallelize.tp.sequence_parallel = false;
  expect_refused(dims(1, 1, 1, 2), tiny(), r, {"overlap_comm", "needs sequence_parallel=true"});
  r.parallelize.tp.sequence_parallel = true;
  r.parallelize.tp_plan = [](TransformerImpl&, const DeviceMesh&) {};
  expect_refused(dims(1, 1, 1, 2), tiny(), r, {"overlap_comm", "custom plan (tp_plan)"});
}

// ---- pipeline parallelism ----

TEST(ParallelDimsValidate, PipelineStagesTakeNoCustomPlan) {
  TrainingOptions r = run_for(dims(2, 1, 1, 1));
  r.parallelize.tp_plan = [](TransformerImpl&, const DeviceMesh&) {};
  expect_refused(dims(2, 1, 1, 1), tiny(), r,
                 {"custom tensor-parallel plan (tp_plan) does not apply to pipeline parallelism "
                  "(pp=2)"});
}

TEST(ParallelDimsValidate, PipelineStagesTakeNoOverlapComm) {
  TrainingOptions r = run_for(dims(2, 1, 1, 1));
  r.parallelize.tp.overlap_comm = true;
  expect_refused(dims(2, 1, 1, 1), tiny(), r,
                 {"overlap_comm does not apply to pipeline parallelism (pp=2)"});
}

TEST(ParallelDimsValidate, PipelineStagesRefuseMixtureOfExpertsLayers) {
  expect_refused(dims(2, 1, 1, 2), DecoderConfig::preset("tiny-moe"), run_for(dims(2, 1, 1, 2)),
                 {"pipeline parallelism (pp=2) with mixture-of-experts layers is not built yet",
                  "auxiliary (load-balancing) loss", "use tp and dp/dp_shard"});
}

TEST(ParallelDimsValidate, PipelineNeedsABlockPerStage) {
  expect_refused(dims(4, 1, 1, 1), tiny(), run_for(dims(4, 1, 1, 1)),
                 {"at least one block per stage", "the model has 2 layers for 4 stages"});
  TrainingOptions r = run_for(dims(2, 1, 1, 1));
  r.pipeline.schedule = "interleaved";
  r.pipeline.virtual_stages = 2;
  expect_refused(dims(2, 1, 1, 1), tiny(), r,
                 {"the model has 2 layers for 4 stages (virtual_stages=2)"});
}

TEST(ParallelDimsValidate, VirtualStagesNeedTheInterleavedSchedule) {
  TrainingOptions r = run_for(dims(2, 1, 1, 1));
  r.pipeline.virtual_stages = 2;
  expect_refused(dims(2, 1, 1, 1), tiny(), r,
                 {"virtual_stages=2", "needs the interleaved schedule"});
  r.pipeline.schedule = "zigzag";
  expect_refused(dims(2, 1, 1, 1), tiny(), r, {"unknown pipeline schedule 'zigzag'"});
}

TEST(ParallelDimsValidate, InterleavedRoundsMustDivideTheMicrobatches) {
  DecoderConfig m = tiny();
  m.n_layers = 4;
  TrainingOptions r = run_for(dims(2, 1, 1, 1), 10);
  r.pipeline.schedule = "interleaved";
  r.pipeline.virtual_stages = 2;
  r.pipeline.microbatches = 5;
  expect_refused(dims(2, 1, 1, 1), m, r, {"use microbatches a multiple of 2 or below 4"});
}

TEST(ParallelDimsValidate, TheBatchMustSplitIntoMicrobatches) {
  TrainingOptions r = run_for(dims(2, 1, 1, 1), 4);
  r.pipeline.microbatches = 3;
  expect_refused(dims(2, 1, 1, 1), tiny(), r,
                 {"the batch of 4 rows does not split into microbatches=3 equal micro-batches"});
  r = run_for(dims(2, 1, 2, 1), 6);
  expect_refused(dims(2, 1, 2, 1), tiny(), r,
                 {"does not split into 2 data-parallel slices of microbatches=2"});
}

// Built now: stages replicated over dp, their gradients averaged (test_parallelize.cpp).
TEST(ParallelDimsValidate, PipelineWithPlainDataParallelismIsALayout) {
  EXPECT_NO_THROW(dims(2, 2, 1, 1).validate(tiny(), run_for(dims(2, 2, 1, 1))));
}

// ---- data parallelism ----

TEST(ParallelDimsValidate, TheBatchMustSplitOverDp) {
  expect_refused(dims(1, 2, 1, 1), tiny(), run_for(dims(1, 2, 1, 1), 3),
                 {"the batch of 3 rows does not split over dp=2 data-parallel ranks"});
}

TEST(ParallelDimsValidate, FsdpTakesNoCustomPlan) {
  TrainingOptions r = run_for(dims(1, 1, 2, 1));
  r.parallelize.tp_plan = [](TransformerImpl&, const DeviceMesh&) {};
  expect_refused(dims(1, 1, 2, 1), tiny(), r,
                 {"custom tensor-parallel plan (tp_plan) does not combine with FSDP (dp_shard=2)"});
}

TEST(ParallelDimsValidate, MixedPrecisionIsFsdpsAndKeepsFloat32Parameters) {
  TrainingOptions r = run_for(dims(1, 2, 1, 1));
  r.parallelize.fsdp.param_dtype = at::kBFloat16;
  expect_refused(dims(1, 2, 1, 1), tiny(), r, {"mixed precision (fsdp.param_dtype) is FSDP's"});
  r = run_for(dims(1, 1, 2, 1));
  r.parallelize.fsdp.param_dtype = at::kBFloat16;
  r.dtype = at::kDouble;
  expect_refused(dims(1, 1, 2, 1), tiny(), r, {"keeps float32 parameters"});
}

TEST(ParallelDimsValidate, FullyShardMustAgreeWithDpShard) {
  TrainingOptions r = run_for(dims(1, 2, 1, 1));
  r.parallelize.fully_shard = true;
  expect_refused(dims(1, 2, 1, 1), tiny(), r, {"fully_shard=true disagrees with dp_shard=1"});
}

// ---- the layout-invariant mode's coverage ----

namespace {
TrainingOptions invariant(const ParallelDims& d, int64_t p) {
  TrainingOptions r = run_for(d);
  r.layout_invariant = p;
  r.parallelize.tp.sequence_parallel = false;
  r.pipeline.microbatches = kLayoutInvariantBatchSegments / d.dp_shard;
  return r;
}
DecoderConfig wide() {
  DecoderConfig m = tiny();
  m.dim = 128;
  m.n_heads = m.n_kv_heads = 4;
  return m;
}
}  // namespace

TEST(ParallelDimsValidate, LayoutInvariantSegmentsAreAPowerOfTwo) {
  expect_refused(dims(1, 1, 1, 1), wide(), invariant(dims(1, 1, 1, 1), 3),
                 {"the layout-invariant mode (P=3)", "a power of two"});
}

TEST(ParallelDimsValidate, LayoutInvariantCoversNoPlainDataParallelism) {
  expect_refused(dims(1, 2, 1, 1), wide(), invariant(dims(1, 2, 1, 1), 4),
                 {"plain data parallelism's all-reduce (dp_replicate=2) is not canonical yet"});
}

TEST(ParallelDimsValidate, LayoutInvariantCoversFsdpUpToTwoRanks) {
  TrainingOptions r = invariant(dims(1, 1, 4, 1), 4);
  r.pipeline.microbatches = 1;
  expect_refused(dims(1, 1, 4, 1), wide(), r, {"covers FSDP (dp_shard) up to 2 ranks"});
}

TEST(ParallelDimsValidate, LayoutInvariantTakesNoMixedPrecision) {
  TrainingOptions r = invariant(dims(1, 1, 2, 1), 4);
  r.parallelize.fsdp.param_dtype = at::kBFloat16;
  expect_refused(dims(1, 1, 2, 1), wide(), r, {"drop FSDP's mixed precision"});
}

TEST(ParallelDimsValidate, LayoutInvariantBatchesSplitIntoTheSegments) {
  TrainingOptions r = invariant(dims(1, 1, 1, 1), 4);
  r.batch_size = 3;
  expect_refused(dims(1, 1, 1, 1), wide(), r, {"cuts each batch into 2 segments"});
}

TEST(ParallelDimsValidate, LayoutInvariantNeedsTpToDivideP) {
  expect_refused(dims(1, 1, 1, 4), wide(), invariant(dims(1, 1, 1, 4), 2),
                 {"the TP degree 4 must divide P"});
}

TEST(ParallelDimsValidate, LayoutInvariantTakesNoOverlapComm) {
  TrainingOptions r = invariant(dims(1, 1, 1, 2), 4);
  r.parallelize.tp.overlap_comm = true;
  r.parallelize.tp.sequence_parallel = true;
  expect_refused(dims(1, 1, 1, 2), wide(), r, {"does not combine with overlap_comm"});
}

TEST(ParallelDimsValidate, LayoutInvariantNeedsWholeKvHeadsPerRank) {
  DecoderConfig m = wide();
  m.n_kv_heads = 1;
  expect_refused(dims(1, 1, 1, 2), m, invariant(dims(1, 1, 1, 2), 4),
                 {"KV heads are replicated over the TP ranks"});
}

TEST(ParallelDimsValidate, LayoutInvariantNeedsColumnShardsOf16) {
  DecoderConfig m = tiny();
  m.n_kv_heads = 4;
  expect_refused(dims(1, 1, 1, 4), m, invariant(dims(1, 1, 1, 4), 4),
                 {"column shards are 8 wide; the mode needs 16 or more"});
}

TEST(ParallelDimsValidate, LayoutInvariantPipelinesRunTheSegmentsAsMicrobatches) {
  TrainingOptions r = invariant(dims(2, 1, 1, 1), 4);
  r.pipeline.microbatches = 4;
  expect_refused(dims(2, 1, 1, 1), wide(), r, {"microbatches must be 2, not 4"});
}

TEST(ParallelDimsValidate, LayoutInvariantPipelinesRunOneStagePerRank) {
  DecoderConfig m = wide();
  m.n_layers = 4;
  TrainingOptions r = invariant(dims(2, 1, 1, 1), 4);
  r.pipeline.schedule = "interleaved";
  r.pipeline.virtual_stages = 2;
  expect_refused(dims(2, 1, 1, 1), m, r, {"runs one stage per rank"});
}

TEST(ParallelDimsValidate, LayoutInvariantPipelinesTakeNoTiedEmbedding) {
  DecoderConfig m = wide();
  m.tie_embeddings = true;
  expect_refused(dims(2, 1, 1, 1), m, invariant(dims(2, 1, 1, 1), 4),
                 {"ties its embedding to its output head"});
}

// ---- meshes and roles ----

TEST(ParallelDims, BuildMeshNamesTheDimsInUseAndHandsOutRoles) {
  run_ranks(4, [](int) {
    ParallelDims d{.dp_shard = 2, .tp = 2, .world_size = 4};
    const DeviceMesh mesh = d.build_mesh("cpu");
    EXPECT_EQ(mesh.dim_names(), (std::vector<std::string>{"dp", "tp"}));
    ASSERT_TRUE(d.mesh("dp_shard"));
    EXPECT_EQ(*d.mesh("dp_shard"), mesh["dp"]);
    EXPECT_EQ(*d.mesh("dp"), mesh["dp"]);
    EXPECT_EQ(*d.mesh("tp"), mesh["tp"]);
    EXPECT_FALSE(d.mesh("dp_replicate"));
    EXPECT_FALSE(d.mesh("pp"));
    EXPECT_FALSE(d.mesh("cp"));
    EXPECT_ERROR(d.mesh("sp"), c10::Error, "unknown role 'sp'");

    ParallelDims one{.tp = 4, .world_size = 4};
    EXPECT_EQ(one.build_mesh("cpu").dim_names(), std::vector<std::string>{"tp"});
  });
}

// The rule every role lookup follows: a dimension by its name; a 1-D mesh without names plays
// the role it is passed for; a 1-D mesh named otherwise plays no other (a "pp" mesh is not TP's).
TEST(ParallelDims, RolesOfAGivenMesh) {
  run_ranks(4, [](int) {
    const auto mesh = init_device_mesh("cpu", {2, 2}, {"pp", "tp"});
    const ParallelDims d = ParallelDims::from_mesh(mesh);
    EXPECT_EQ(d.pp, 2);
    EXPECT_EQ(d.tp, 2);
    EXPECT_EQ(*d.mesh("pp"), mesh["pp"]);
    const auto unnamed = init_device_mesh("cpu", {4});
    EXPECT_EQ(ParallelDims::from_mesh(unnamed).tp, 4);
    EXPECT_EQ(*ParallelDims::from_mesh(unnamed).mesh("tp"), unnamed);
    EXPECT_FALSE(ParallelDims::from_mesh(unnamed).mesh("pp"));
    EXPECT_EQ(*ParallelDims::from_mesh(unnamed, false, "pp").mesh("pp"), unnamed);
    const auto dp = init_device_mesh("cpu", {4}, {"dp"});
    EXPECT_FALSE(ParallelDims::from_mesh(dp).mesh("tp"));
    EXPECT_EQ(*ParallelDims::from_mesh(dp, /*dp_shards=*/true).mesh("dp_shard"), dp);
    EXPECT_FALSE(ParallelDims::from_mesh(dp, /*dp_shards=*/true).mesh("dp_replicate"));
    EXPECT_FALSE(mesh_for_role(init_device_mesh("cpu", {4}, {"pp"}), "tp"));
    EXPECT_EQ(*mesh_for_role(mesh, "tp"), mesh["tp"]);
  });
}
