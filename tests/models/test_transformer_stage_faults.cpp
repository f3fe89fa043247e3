// Faults in a training step of the tiny Llama on the 3-D mesh (pp, dp, tp) = (2, 2, 2) of 8
// ranks, laid out as in test_transformer_stage.cpp (TP per stage, fully_shard over "dp", 1F1B or
// interleaved 1F1B with v = 2, M = 2): rank 5 (pp 1, dp 0, tp 1) is killed (SIGKILL) or throws
// when its first stage's forward of micro-batch 1 starts, after that stage's forward and (1F1B)
// backward of micro-batch 0. Every other rank, in rank 5's pp, dp and tp groups and beyond, must
// end within seconds naming rank 5, its own stage and what it was waiting in: never hang.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/models/meta_init.h"
#include "dtensor/models/parallelize.h"
#include "dtensor/models/transformer_stage.h"
#include "dtensor/pp/pipeline.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/llama_stages.h"
#include "support/rank_outcomes.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

constexpr int kRanks = 8;
constexpr int kFailed = 5;        // pp 1, dp 0, tp 1: its peers are 1 (pp), 7 (dp) and 4 (tp)
constexpr double kTimeout = 3.0;  // comm timeout, seconds
constexpr double kLinger = 6.0;   // how long a rank that threw stays before exiting, seconds
const RunOptions kOpts{.timeout = std::chrono::seconds(60),
                       .comm_timeout = std::chrono::seconds(3)};

enum class Kind { OneFOneB, Interleaved };
enum class Fault { Throw, Kill };

// One step of this rank's stages; rank kFailed meets `fault`.
void train(int rank, Kind kind, Fault fault) {
  auto mesh = init_device_mesh("cpu", {2, 2, 2}, {"pp", "dp", "tp"});
  const auto config = tiny_pipeline_llama(false);
  Transformer whole = meta_transformer(config);
  TransformerPipeline p =
      parallelize_pipeline(*whole, mesh, {.tp = {.loss_parallel = true}, .fully_shard = true},
                           {.schedule = kind == Kind::Interleaved ? "interleaved" : "1f1b",
                            .virtual_stages = kind == Kind::Interleaved ? 2 : 1,
                            .microbatches = 2},
                           [](TransformerImpl& w) { w.init_weights(11); });
  int calls = 0;
  if (rank == kFailed) {
    // The first stage's first block, after the stage's own FSDP and TP pre-hooks have run.
    auto* block = p.stages.front()->layers->begin()->value()->as<TransformerBlockImpl>();
    block->register_forward_pre_hook([&calls, fault](torch::nn::Module&, tp::ModuleCall&) {
      if (++calls != 2) return;
      if (fault == Fault::Kill) ::raise(SIGKILL);
      TORCH_CHECK(false, "injected failure");
    });
  }
  auto tokens = at::randint(config.vocab_size, {2, 8}, at::kLong);
  try {
    p.schedule->step(tokens, tokens);
  } catch (...) {
    // The failed rank lingers (its connections stay open): the others must end on its failure
    // report, not on broken connections.
    if (rank == kFailed) std::this_thread::sleep_for(std::chrono::duration<double>(kLinger));
    throw;
  }
}

const char* kind_name(Kind k) { return k == Kind::OneFOneB ? "1F1B" : "interleaved"; }

// Rank `r` ended, neither hung nor successful, naming its own stage and what it did there, the
// collective or message it was in, and rank 5.
void expect_named(const RankOutcome& o, int r, const std::string& what) {
  EXPECT_FALSE(o.hung) << what;
  EXPECT_TRUE(WIFEXITED(o.status) && WEXITSTATUS(o.status) == 2) << what;
  const std::regex stage("rank " + std::to_string(r) +
                         " threw: dtensor: pipeline stage [0-3] of [24] \\(rank " +
                         std::to_string(r) + "\\), (forward|backward) of micro-batch [01]: ");
  EXPECT_TRUE(std::regex_search(o.message, stage)) << what;
  const std::regex op(
      "(all_reduce|all_gather_into_tensor|reduce_scatter_tensor|send|recv) .*"
      "(collective|message) #[0-9]+ on (group|channel) ");
  EXPECT_TRUE(std::regex_search(o.message, op)) << what;
  EXPECT_CONTAINS(o.message, "rank 5");
}

std::vector<RankOutcome> run(Kind kind, Fault fault) {
  auto out = run_ranks_collect(
      kRanks, [kind, fault](int rank) { train(rank, kind, fault); }, kOpts);
  if (std::getenv("DTENSOR_TEST_TRACE")) std::fprintf(stderr, "%s", describe_outcomes(out).c_str());
  return out;
}

}  // namespace

TEST(LlamaPipelineFaults, ARankKilledMidStepEndsEveryRankNamingIt) {
  for (Kind kind : {Kind::OneFOneB, Kind::Interleaved}) {
    SCOPED_TRACE(kind_name(kind));
    auto out = run(kind, Fault::Kill);
    const std::string what = describe_outcomes(out);
    ASSERT_EQ(out.size(), static_cast<size_t>(kRanks));
    ASSERT_TRUE(!out[kFailed].hung && WIFSIGNALED(out[kFailed].status)) << what;
    for (int r = 0; r < kRanks; ++r) {
      if (r == kFailed) continue;
      SCOPED_TRACE("rank " + std::to_string(r));
      expect_named(out[r], r, what);
      // Its own diagnosis, or that of the peer whose failure report reached it first.
      EXPECT_CONTAINS(out[r].message, "rank 5 did not answer within 1 s (stopped, killed, or busy");
      // Those waiting for rank 5 see its connections close, or (the others) their peers' reports.
      EXPECT_LT(out[r].seconds - out[kFailed].seconds, kTimeout + 2.0) << what;
    }
  }
}

TEST(LlamaPipelineFaults, AStageThatRaisesEndsEveryRankNamingIt) {
  for (Kind kind : {Kind::OneFOneB, Kind::Interleaved}) {
    SCOPED_TRACE(kind_name(kind));
    auto out = run(kind, Fault::Throw);
    const std::string what = describe_outcomes(out);
    ASSERT_EQ(out.size(), static_cast<size_t>(kRanks));
    EXPECT_CONTAINS(out[kFailed].message,
                    std::string("rank 5 threw: dtensor: pipeline stage 1 of ") +
                        (kind == Kind::Interleaved ? "4" : "2") +
                        " (rank 5), forward of micro-batch 1: injected failure");
    for (int r = 0; r < kRanks; ++r) {
      if (r == kFailed) continue;
      SCOPED_TRACE("rank " + std::to_string(r));
      expect_named(out[r], r, what);
      EXPECT_CONTAINS(out[r].message, "rank 5 failed: dtensor: pipeline stage 1 of ");
      EXPECT_CONTAINS(out[r].message, "injected failure");
      // On rank 5's report, seconds before it exits and closes its connections.
      EXPECT_LT(out[r].seconds, out[kFailed].seconds - (kLinger - kTimeout)) << what;
    }
  }
}
