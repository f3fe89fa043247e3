// replicate (plain data parallelism) on the tiny decoder: each dp rank trains on its rows of the
// batch, and after each backward the gradients are averaged over dp in buckets: three AdamW steps
// give one device's loss, gradients and parameters on the whole batch (float64, 1e-9), with one
// bucket and with several, each backward issuing exactly one all_reduce per bucket; deferred
// synchronisation accumulates micro-batches locally and averages once; bad uses are refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <string>

#include "dtensor/dtensor.h"
#include "dtensor/fsdp/fully_shard.h"
#include "dtensor/fsdp/replicate.h"
#include "dtensor/models/transformer.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

constexpr int64_t kBatch = 4, kSeq = 8;

Transformer make_model() {
  auto c = DecoderConfig::preset("tiny");
  c.vocab_size = 64;
  Transformer m(c);
  m->to(at::kDouble);
  m->init_weights(3);
  return m;
}

// Three steps at dp = 2 against one device; `microbatches` backwards per step, all but the last
// with gradient sync off.
void expect_matches_one_device(int64_t bucket_bytes, int64_t microbatches) {
  run_ranks(2, [=](int rank) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    Transformer ref = make_model(), model = make_model();
    fsdp::replicate(*model, mesh, {.bucket_bytes = bucket_bytes});
    const int64_t buckets = fsdp::replicate_buckets(*model, bucket_bytes);
    if (bucket_bytes > 0) {
      EXPECT_GT(buckets, 1);
    } else {
      EXPECT_EQ(buckets, 1);
    }
    const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    torch::optim::AdamW ref_opt(ref->parameters(), opt), model_opt(model->parameters(), opt);
    const auto ref_params = params_of(*ref), params = params_of(*model);
    const int64_t rows = kBatch / 2 / microbatches;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      auto tokens = at::randint(64, {kBatch, kSeq}, at::kLong);
      auto targets = at::randint(64, {kBatch, kSeq}, at::kLong);
      ref_opt.zero_grad();
      model_opt.zero_grad();
      loss_and_backward(ref->forward(tokens), targets);
      CommDebugMode comm;
      for (int64_t i = 0; i < microbatches; ++i) {
        if (microbatches > 1) {
          EXPECT_EQ(fsdp::set_requires_gradient_sync(*model, i == microbatches - 1), 1);
        }
        const int64_t first = rank * (kBatch / 2) + i * rows;
        loss_and_backward(model->forward(tokens.narrow(0, first, rows)),
                          targets.narrow(0, first, rows));
      }
      comm.exit();
      EXPECT_EQ(comm.get_comm_counts(), (CommCounts{{CommType::all_reduce, buckets}}));
      for (const auto& [name, p] : params) {
        SCOPED_TRACE(name);
        ASSERT_TRUE(p.grad().defined());
        // M micro-batches of a mean loss each: their gradients sum to M times the mean's.
        EXPECT_TRUE(close_to_scale(p.grad() / static_cast<double>(microbatches),
                                   ref_params.at(name).grad(), 1e-9))
            << "averaged gradient";
      }
      if (microbatches > 1) {
        at::NoGradGuard no_grad;
        for (const auto& [name, p] : params) p.grad().div_(static_cast<double>(microbatches));
      }
      ref_opt.step();
      model_opt.step();
      for (const auto& [name, p] : params) {
        SCOPED_TRACE(name);
        EXPECT_TRUE(close_to_scale(p, ref_params.at(name), 1e-9)) << "parameter after the step";
      }
    }
  });
}

}  // namespace

TEST(Replicate, OneBucketAveragesLikeOneDeviceOnTheWholeBatch) {
  expect_matches_one_device(/*bucket_bytes=*/0, /*microbatches=*/1);
}

TEST(Replicate, SeveralBucketsIssueOneAllReduceEach) {
  expect_matches_one_device(/*bucket_bytes=*/16 * 1024, /*microbatches=*/1);
}

TEST(Replicate, DeferredSyncAccumulatesMicrobatchesAndAveragesOnce) {
  expect_matches_one_device(/*bucket_bytes=*/0, /*microbatches=*/2);
}

TEST(Replicate, RefusesModulesWithoutHooksAndMeshesOfSeveralDims) {
  run_ranks(2, [](int) {
    torch::nn::Linear plain(2, 2);
    EXPECT_ERROR(fsdp::replicate(*plain, init_device_mesh("cpu", {2}, {"dp"})), c10::Error,
                 "has no forward hooks");
    Transformer model = make_model();
    EXPECT_ERROR(fsdp::replicate(*model, init_device_mesh("cpu", {1, 2}, {"dp", "tp"})), c10::Error,
                 "needs a 1-D dp mesh");
  });
}
