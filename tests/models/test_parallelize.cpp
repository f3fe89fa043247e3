// The library's entry point for a whole model, models::parallelize: TP over "tp", AC, FSDP over
// "dp" on one named mesh, and dtensor::nn::utils::clip_grad_norm_ over the result. At (dp, tp) =
// (2, 2) with FSDP and AC, (4, 1) with FSDP, (1, 4) TP alone, tied and untied, two AdamW steps with
// clipping give one device's loss, norm, clipped gradients and parameters (float64, 1e-9); the dp
// ranks each train on their rows of the batch (FSDP averages the gradients). Pipeline stages are
// tested in test_transformer_stage.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <string>

#include "dtensor/dtensor.h"
#include "dtensor/models/parallelize.h"
#include "dtensor/nn/clip_grad.h"
#include "support/distributed.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

constexpr int64_t kBatch = 4, kSeq = 8;

DecoderConfig tiny(bool tied) {
  auto c = DecoderConfig::preset("tiny");
  c.vocab_size = 64;
  c.n_layers = 2;
  c.tie_embeddings = tied;
  return c;
}

// Whether `t` (parameter `p` or its gradient, as this rank holds it) is the one-device tensor
// `full`: a DTensor (an FSDP leaf among them) gathered whole.
::testing::AssertionResult matches(const at::Tensor& t, const at::Tensor& full) {
  return close_to_scale(whole(t), full, 1e-9);
}

// Each parameter once, by its first name (a tied head is the embedding).
Params unique_params_of(const torch::nn::Module& m) {
  Params out;
  for (const auto& p : unique_named_parameters(m)) out[p.key()] = p.value();
  return out;
}

void expect_matches_one_device(int64_t dp, int64_t tp, bool fully_shard, bool ac) {
  run_ranks(static_cast<int>(dp * tp), [=](int) {
    auto mesh = init_device_mesh("cpu", {dp, tp}, {"dp", "tp"});
    const int64_t rows = kBatch / dp, first_row = mesh.get_local_rank("dp") * rows;
    for (bool tied : {false, true}) {
      SCOPED_TRACE(std::string(tied ? "tied" : "untied"));
      Transformer ref(tiny(tied)), model(tiny(tied));
      for (auto* m : {&ref, &model}) {
        (*m)->to(at::kDouble);
        (*m)->init_weights(5);
      }
      ParallelizeOptions par{.ac = ac ? ac::ACMode::full : ac::ACMode::none,
                             .fully_shard = fully_shard};
      parallelize(*model, mesh, par);
      // TP exactly when the "tp" dim has more than one rank (a DTensor whose mesh has it, FSDP's
      // leaves included); FSDP leaves no parameter unsharded.
      bool any_tp = false, all_shards = true;
      for (const auto& p : unique_parameters(*model)) {
        if (is_dtensor(p)) {
          const auto& names = device_mesh(p).dim_names();
          any_tp = any_tp || std::find(names.begin(), names.end(), "tp") != names.end();
        }
        all_shards = all_shards && fsdp::is_fsdp_shard(p);
      }
      EXPECT_EQ(any_tp, tp > 1);
      EXPECT_EQ(all_shards, fully_shard);
      const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
      torch::optim::AdamW ref_opt(unique_parameters(*ref), opt),
          model_opt(unique_parameters(*model), opt);
      const auto ref_params = unique_params_of(*ref), params = unique_params_of(*model);
      ASSERT_EQ(params.size(), ref_params.size());
      for (int step = 0; step < 2; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        auto tokens = at::randint(64, {kBatch, kSeq}, at::kLong);
        auto targets = at::randint(64, {kBatch, kSeq}, at::kLong);
        ref_opt.zero_grad();
        model_opt.zero_grad();
        auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
        auto loss = loss_and_backward(model->forward(tokens.narrow(0, first_row, rows)),
                                      targets.narrow(0, first_row, rows));
        reduce_partial_grads(*model);
        const double ref_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*ref), 0.5);
        const double norm = dtensor::nn::utils::clip_grad_norm_(unique_parameters(*model), 0.5);
        EXPECT_GT(ref_norm, 0.5);  // the gradients are scaled
        EXPECT_NEAR(norm, ref_norm, 1e-9 * ref_norm) << "gradient norm";
        const double mean_loss =
            comm::all_reduce(loss, ReduceOp::Sum, mesh.group(0)).item<double>() / dp;
        EXPECT_NEAR(mean_loss, ref_loss.item<double>(), 1e-9) << "loss";
        for (const auto& [name, p] : params) {
          SCOPED_TRACE(name);
          ASSERT_TRUE(p.grad().defined());
          EXPECT_TRUE(matches(p.grad(), ref_params.at(name).grad())) << "clipped gradient";
        }
        ref_opt.step();
        model_opt.step();
        for (const auto& [name, p] : params) {
          SCOPED_TRACE(name);
          EXPECT_TRUE(matches(p, ref_params.at(name))) << "parameter after the step";
        }
      }
    }
  });
}

}  // namespace

TEST(Parallelize, FsdpOverTensorParallelWithAcMatchesOneDeviceDp2Tp2) {
  expect_matches_one_device(2, 2, /*fully_shard=*/true, /*ac=*/true);
}
TEST(Parallelize, FsdpAloneMatchesOneDeviceDp4) {
  expect_matches_one_device(4, 1, /*fully_shard=*/true, /*ac=*/false);
}
TEST(Parallelize, TensorParallelAloneMatchesOneDeviceTp4) {
  expect_matches_one_device(1, 4, /*fully_shard=*/false, /*ac=*/true);
}
// "dp" without fully_shard: the ranks replicate the model and average its gradients (replicate).
TEST(Parallelize, ReplicatedOverTensorParallelMatchesOneDeviceDp2Tp2) {
  expect_matches_one_device(2, 2, /*fully_shard=*/false, /*ac=*/false);
}

// A mesh without "dp" cannot be fully sharded: the error names the mesh and the dim.
TEST(Parallelize, FullyShardWithoutADpDimIsRefusedNamingIt) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    Transformer model(tiny(false));
    try {
      parallelize(*model, mesh, {.fully_shard = true});
      ADD_FAILURE() << "no error";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("dimension named \"dp\""), std::string::npos)
          << e.what();
    }
  });
}
