// The Llama pipeline composed with FSDP (or plain replication) and TP on a 3-D mesh ("pp", "dp",
// "tp") by the library's entry point, parallelize_pipeline, in KempnerForge's order: each stage's
// blocks get TP (no sequence parallelism), then AC, then fully_shard over "dp" (every block a unit
// with reshard_after_forward, the stage's root with the embedding, norm and head). At (pp, dp, tp)
// = (2, 2, 1), (2, 1, 2), (2, 2, 2) and (4, 2, 1), GPipe, 1F1B and interleaved 1F1B (v = 2) with
// M = 2 and 4 micro-batches per dp rank, tied and untied embeddings, three AdamW steps give the
// loss, every gradient (clipped by one nn::utils::clip_grad_norm_ to a max norm below the norm)
// and every parameter of one device on the whole batch (float64, 1e-9); so do stages replicated
// over dp at (2, 2, 1) and (2, 2, 2) with M = 2. Per step, every rank issues exactly one
// all-gather and one reduce-scatter per FSDP unit on its dp group (the schedule defers the
// gradient sync to each stage's last micro-batch, and the units keep their gathered parameters
// meanwhile), or one all_reduce per replicated stage, and the point-to-point messages of the
// pipeline alone; the TP all_reduces summed over the stages of a pp group are the whole model's
// under the same plan, M times.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "dtensor/ac/checkpoint.h"
#include "dtensor/dtensor.h"
#include "dtensor/fsdp/fully_shard.h"
#include "dtensor/models/meta_init.h"
#include "dtensor/models/parallelize.h"
#include "dtensor/models/transformer_stage.h"
#include "dtensor/pp/pipeline.h"
#include "support/distributed.h"
#include "support/llama_stages.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

constexpr int64_t kSeq = 8;

enum class Kind { GPipe, OneFOneB, Interleaved };
const char* kind_name(Kind k) {
  return k == Kind::GPipe ? "GPipe" : k == Kind::OneFOneB ? "1F1B" : "interleaved";
}

// This rank's stages of the tiny Llama from seed 11 on `mesh`, parallelized by the library's
// entry point (models/parallelize.h), and their schedule.
struct Built : LlamaStages {
  int64_t fsdp_units = 0;  // on this rank
  dtensor::nn::utils::ClipGradNormOptions clip;
};

Built build(const DeviceMesh& mesh, const DecoderConfig& config, Kind kind, bool ac,
            int64_t microbatches, bool fully_shard) {
  Transformer whole = meta_transformer(config);  // no rank holds the whole model
  whole->to(at::kDouble);
  ParallelizeOptions par{.tp = {.loss_parallel = true},
                         .ac = ac ? ac::ACMode::full : ac::ACMode::none,
                         .fully_shard = fully_shard};
  TransformerPipeline p =
      parallelize_pipeline(*whole, mesh, par,
                           {.schedule = kind == Kind::GPipe      ? "gpipe"
                                        : kind == Kind::OneFOneB ? "1f1b"
                                                                 : "interleaved",
                            .virtual_stages = kind == Kind::Interleaved ? 2 : 1,
                            .microbatches = microbatches},
                           [](TransformerImpl& w) { w.init_weights(11); });
  Built b;
  b.clip = p.clip_options();
  b.stages = std::move(p.stages);
  b.pipes = std::move(p.pipes);
  b.schedule = std::move(p.schedule);
  for (auto& st : b.stages) b.fsdp_units += fsdp::set_requires_gradient_sync(*st, true);
  return b;
}

int64_t count(const CommCounts& c, CommType t) {
  auto it = c.find(t);
  return it == c.end() ? 0 : it->second;
}

// M = `microbatches` per dp rank; the batch has max(4, dp M) rows. The dp ranks shard the stages
// (FSDP) or, without `fully_shard`, replicate them (their gradients averaged after the last
// micro-batch, one all_reduce per stage).
void expect_layout_matches(int64_t pp, int64_t dp, int64_t tp, int64_t microbatches,
                           bool fully_shard = true) {
  run_ranks(static_cast<int>(pp * dp * tp), [pp, dp, tp, microbatches, fully_shard](int) {
    auto mesh = init_device_mesh("cpu", {pp, dp, tp}, {"pp", "dp", "tp"});
    const int64_t kMicrobatches = microbatches, kBatch = std::max<int64_t>(4, dp * microbatches);
    const int64_t dp_rank = mesh.get_local_rank("dp"), rows = kBatch / dp;
    auto& dp_group = mesh.group(mesh.dim_index("dp"));
    for (bool tied : {false, true}) {
      for (Kind kind : {Kind::GPipe, Kind::OneFOneB, Kind::Interleaved}) {
        const bool ac = tied;  // AC on half of the cases keeps the suite short
        SCOPED_TRACE("(pp, dp, tp) = (" + std::to_string(pp) + ", " + std::to_string(dp) + ", " +
                     std::to_string(tp) + ") M = " + std::to_string(microbatches) + " " +
                     kind_name(kind) + (tied ? " tied" : " untied") + (ac ? " AC" : ""));
        // Enough blocks for pp stages of v = 2.
        const auto config = tiny_pipeline_llama(tied, std::max<int64_t>(4, 2 * pp));
        Transformer ref(config);
        ref->to(at::kDouble);
        ref->init_weights(11);
        Built b = build(mesh, config, kind, ac, kMicrobatches, fully_shard);
        // FSDP units on this rank: each of its stages' blocks, and the stage itself where it
        // holds the embedding or the norm and head (stages 0 and S - 1).
        const int64_t v = kind == Kind::Interleaved ? 2 : 1, stages = v * pp;
        int64_t units = 0;
        for (int64_t k = 0; k < v; ++k) {
          const int64_t g = k * pp + mesh.get_local_rank("pp");
          const auto [first, end] = pp::stage_layer_range(config.n_layers, g, stages);
          units += (end - first) + (g == 0 || g == stages - 1 ? 1 : 0);
        }
        if (!fully_shard) units = v;  // each stage one replicated unit
        EXPECT_EQ(b.fsdp_units, units);
        // The dp group's all_reduces per step: one per replicated stage (one bucket each).
        const int64_t dp_reductions = !fully_shard && dp > 1 ? v : 0;
        const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
        torch::optim::AdamW ref_opt(ref->parameters(), opt), opt_stage(b.parameters(), opt);
        const auto ref_params = params_of(*ref), params = b.params();
        for (const auto& [name, p] : params) {
          SCOPED_TRACE(name);
          ASSERT_TRUE(ref_params.count(name));
          EXPECT_TRUE(close_to_scale(local_of(p), part_like(p, ref_params.at(name)), 0.0));
        }
        CommCounts counts;
        for (int step = 0; step < 3; ++step) {
          SCOPED_TRACE("step " + std::to_string(step));
          auto tokens = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
          auto targets = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
          ref_opt.zero_grad();
          opt_stage.zero_grad();
          auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
          CommDebugMode debug;
          auto loss = b.schedule->step(tokens.narrow(0, dp_rank * rows, rows),
                                       targets.narrow(0, dp_rank * rows, rows));
          for (auto& st : b.stages) reduce_partial_grads(*st);
          debug.exit();
          // One clip_grad_norm_ for the layout: the norm of one device's gradients, and the
          // gradients scaled as LibTorch's clip_grad_norm_ scales them (max_norm below the norm).
          const double ref_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*ref), 0.5);
          const double norm = dtensor::nn::utils::clip_grad_norm_(b.parameters(), 0.5, b.clip);
          EXPECT_NEAR(norm, ref_norm, 1e-9 * ref_norm) << "gradient norm";
          EXPECT_GT(ref_norm, 0.5);
          counts = debug.get_comm_counts();
          // One all-gather and one reduce-scatter per unit and step (dp > 1: a 1-rank group's
          // collectives are not issued).
          if (dp > 1 && fully_shard) {
            EXPECT_EQ(count(counts, CommType::all_gather_into_tensor), units) << debug.table();
            EXPECT_EQ(count(counts, CommType::reduce_scatter_tensor), units) << debug.table();
          }
          // The pipeline's messages: M per boundary of each of this rank's stages and direction,
          // one per tied stage, and (first step) the activation shapes.
          const int64_t r = mesh.get_local_rank("pp");
          const int64_t first = r == 0 ? 1 : 0, last = r == pp - 1 ? 1 : 0;
          const int64_t messages =
              kMicrobatches * (2 * v - first - last) + (tied ? first + last : 0);
          EXPECT_EQ(count(counts, CommType::send), messages + (step == 0 ? v - last : 0));
          EXPECT_EQ(count(counts, CommType::recv), messages + (step == 0 ? v - first : 0));
          EXPECT_EQ(loss.defined(), b.holds_last());
          if (loss.defined()) {
            at::Tensor mean = comm::all_reduce(loss, ReduceOp::Sum, dp_group) / dp;
            EXPECT_TRUE(close_to_scale(mean, ref_loss, 1e-9)) << "loss";
          }
          for (const auto& [name, p] : params) {
            SCOPED_TRACE(name);
            ASSERT_TRUE(p.grad().defined());
            // FSDP's gradients have their leaves' placements; replicated TP keeps a gradient's
            // own (a rowwise embedding's is a whole Replicate): compared whole.
            EXPECT_TRUE(fully_shard
                            ? close_to_scale(local_of(p.grad()),
                                             part_like(p, ref_params.at(name).grad()), 1e-9)
                            : close_to_scale(whole(p.grad()), ref_params.at(name).grad(), 1e-9))
                << "gradient";
          }
          ref_opt.step();
          opt_stage.step();
          for (const auto& [name, p] : params) {
            SCOPED_TRACE(name);
            EXPECT_TRUE(close_to_scale(local_of(p), part_like(p, ref_params.at(name)), 1e-9))
                << "parameter after the step";
          }
        }
        // TP's collectives (all_reduce only without sequence parallelism; FSDP's are
        // all-gathers and reduce-scatters) summed over the stages of a pp group: the whole model
        // under the same plan on one micro-batch, M times (AC's recomputes replay them).
        const int64_t mine = count(counts, CommType::all_reduce) - dp_reductions;
        const int64_t total = comm::all_reduce(at::tensor({mine}, at::kLong), ReduceOp::Sum,
                                               mesh.group(mesh.dim_index("pp")))
                                  .item<int64_t>();
        int64_t expected = 0;
        if (tp > 1) {
          Transformer whole(config);
          whole->to(at::kDouble);
          apply_tensor_parallel(*whole, mesh, {.sequence_parallel = false, .loss_parallel = true});
          auto tokens = at::randint(config.vocab_size, {rows / kMicrobatches, kSeq}, at::kLong);
          CommDebugMode debug;
          loss_and_backward(whole->forward(tokens), tokens);
          reduce_partial_grads(*whole);
          debug.exit();
          expected = kMicrobatches * count(debug.get_comm_counts(), CommType::all_reduce);
          EXPECT_GT(expected, 0);
        }
        EXPECT_EQ(total, expected) << "TP all_reduces over the stages of a pp group";
      }
    }
  });
}

}  // namespace

// A rank's stages get memory; the rest of the model stays shapes, so it goes when the whole
// does. Values are checked against one device by the training tests below.
TEST(TransformerPipeline, InitStageWeightsGivesMemoryToThisRanksStagesOnly) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"pp"});
    for (bool tied : {false, true}) {
      SCOPED_TRACE(tied ? "tied" : "untied");
      Transformer whole = meta_transformer(tiny_pipeline_llama(tied));
      auto stages = split_transformer_stages(*whole, mesh, 2);
      init_stage_weights(stages, *whole, 11);
      std::set<std::string> held;
      for (const auto& st : stages)
        for (const auto& p : st->named_parameters()) {
          EXPECT_FALSE(p.value().is_meta()) << p.key();
          held.insert(p.key());
        }
      // The last stage's copy of a tied embedding is drawn from the embedding's generator.
      const bool drew_embedding = tied && mesh.get_local_rank() == 1;
      for (const auto& p : whole->named_parameters()) {
        const bool expect_memory =
            held.count(p.key()) > 0 || (drew_embedding && p.key() == "tok_embeddings.weight");
        EXPECT_EQ(p.value().is_meta(), !expect_memory) << p.key();
      }
    }
  });
}

// Which stage holds each parameter comes from the split itself: the embedding on the first, the
// blocks by stage_layer_range, the norm and head on the last (a tied head registers none).
TEST(TransformerPipeline, StageOfParametersFollowsTheSplit) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    Transformer whole = meta_transformer(tiny_pipeline_llama(tied));
    const auto owners = stage_of_parameters(*whole, 4);
    EXPECT_EQ(owners.size(), unique_named_parameters(*whole).size());
    EXPECT_EQ(owners.at("tok_embeddings.weight"), 0);
    EXPECT_EQ(owners.at("norm.weight"), 3);
    EXPECT_EQ(owners.count("output.weight"), tied ? 0u : 1u);
    for (int64_t layer = 0; layer < 4; ++layer)
      EXPECT_EQ(owners.at("layers." + std::to_string(layer) + ".attention.wq.weight"), layer);
  }
}

TEST(LlamaPipelineFsdp, TrainingMatchesOneDevicePp2Dp2) {
  for (int64_t m : {2, 4}) expect_layout_matches(2, 2, 1, m);
}
TEST(LlamaPipelineFsdp, TrainingMatchesOneDevicePp2Tp2) {
  for (int64_t m : {2, 4}) expect_layout_matches(2, 1, 2, m);
}
TEST(LlamaPipelineFsdp, TrainingMatchesOneDevicePp2Dp2Tp2) {
  for (int64_t m : {2, 4}) expect_layout_matches(2, 2, 2, m);
}
TEST(LlamaPipelineFsdp, TrainingMatchesOneDevicePp4Dp2) {
  for (int64_t m : {2, 4}) expect_layout_matches(4, 2, 1, m);
}
// Pipeline stages replicated over plain data parallelism (dtensor_train --pp with --dp).
TEST(LlamaPipelineReplicate, TrainingMatchesOneDevicePp2Dp2) {
  expect_layout_matches(2, 2, 1, 2, /*fully_shard=*/false);
}
TEST(LlamaPipelineReplicate, TrainingMatchesOneDevicePp2Dp2Tp2) {
  expect_layout_matches(2, 2, 2, 2, /*fully_shard=*/false);
}
