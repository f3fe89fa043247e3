// fully_shard on the Llama model: with every TransformerBlock and the root sharded over dp, three
// AdamW steps on each rank's slice of the batch give the loss, the gradients and the parameters
// of one device training on the whole batch; each unit issues exactly one all-gather in forward
// and one reduce-scatter in backward; bad meshes and unsupported parameters are refused clearly.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <string>

#include "dtensor/dtensor.h"
#include "dtensor/models/llama.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

LlamaConfig tiny() {
  auto c = LlamaConfig::preset("tiny");
  c.vocab_size = 66;  // 66 rows split unevenly over 4 ranks (17, 17, 17, 15)
  return c;
}

void shard_model(TransformerImpl& model, const DeviceMesh& dp_mesh) {
  for (auto& block : *model.layers) fsdp::fully_shard(*block, dp_mesh);
  fsdp::fully_shard(model, dp_mesh);
}

void expect_training_matches(int64_t dp) {
  SCOPED_TRACE("dp=" + std::to_string(dp));
  auto mesh = init_device_mesh("cpu", {dp}, {"dp"});
  const int64_t rank = mesh.get_local_rank();
  const auto config = tiny();
  Transformer ref(config), model(config);
  ref->to(at::kDouble);
  model->to(at::kDouble);
  ref->init_weights(11);
  model->init_weights(11);
  shard_model(*model, mesh);
  const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW ref_opt(ref->parameters(), opt), dp_opt(model->parameters(), opt);

  const auto ref_params = params_of(*ref), dp_params = params_of(*model);
  ASSERT_EQ(ref_params.size(), dp_params.size());
  // This rank's rows of the one-device tensor `full` for shard `p`.
  auto rows_of = [](const at::Tensor& full, const at::Tensor& p) {
    return full.narrow(0, fsdp::shard_info(p).row_offset, p.size(0));
  };
  for (const auto& [name, p] : dp_params) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(fsdp::is_fsdp_shard(p));
    EXPECT_TRUE(p.is_leaf());
    EXPECT_EQ(fsdp::shard_info(p).full_rows, ref_params.at(name).size(0));
    EXPECT_TRUE(close_to_scale(p, rows_of(ref_params.at(name), p), 0.0)) << "initial value";
  }
  const int64_t units = config.n_layers + 1;
  const int64_t b = 2;  // sequences per rank
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // The same global batch on every rank (run_ranks seeds ranks alike); each takes its slice.
    auto tokens = at::randint(config.vocab_size, {b * dp, 8}, at::kLong);
    auto targets = at::randint(config.vocab_size, {b * dp, 8}, at::kLong);
    ref_opt.zero_grad();
    dp_opt.zero_grad();
    auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
    at::Tensor loss;
    {
      CommDebugMode comm;
      loss = loss_and_backward(model->forward(tokens.narrow(0, b * rank, b)),
                               targets.narrow(0, b * rank, b));
      comm.exit();
      const auto counts = comm.get_comm_counts();
      EXPECT_EQ(comm.get_total_counts(), 2 * units) << format_comm_counts(counts);
      EXPECT_EQ(counts.count(CommType::all_gather_into_tensor)
                    ? counts.at(CommType::all_gather_into_tensor)
                    : 0,
                units);
      EXPECT_EQ(counts.count(CommType::reduce_scatter_tensor)
                    ? counts.at(CommType::reduce_scatter_tensor)
                    : 0,
                units);
    }
    // Equal slices: the whole batch's mean loss is the mean of the ranks' losses.
    auto mean_loss = comm::all_reduce(loss.detach(), ReduceOp::Sum, mesh.group(0)) / dp;
    EXPECT_TRUE(close_to_scale(mean_loss, ref_loss, 1e-9)) << "loss";
    for (const auto& [name, p] : dp_params) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_TRUE(close_to_scale(p.grad(), rows_of(ref_params.at(name).grad(), p), 1e-9))
          << "gradient";
    }
    ref_opt.step();
    dp_opt.step();
    for (const auto& [name, p] : dp_params) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(close_to_scale(p, rows_of(ref_params.at(name), p), 1e-9)) << "parameter";
    }
  }
}

TEST(FullyShard, LlamaTrainingMatchesOneDeviceDp2) {
  run_ranks(2, [](int) { expect_training_matches(2); });
}

TEST(FullyShard, LlamaTrainingMatchesOneDeviceDp4) {
  run_ranks(4, [](int) { expect_training_matches(4); });
}

TEST(FullyShard, RefusesBadMeshesAndTensorParallelParameters) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    Transformer model(tiny());
    EXPECT_CONTAINS(message_of([&] { fsdp::fully_shard(*model, mesh); }),
                    "expected a 1-D data-parallel mesh");
    apply_tensor_parallel(*model, mesh["tp"]);
    EXPECT_CONTAINS(message_of([&] { fsdp::fully_shard(*model->layers[0], mesh["dp"]); }),
                    "is a DTensor");
  });
}

}  // namespace

// A model sharded and dropped, then another: the new model's parameters are all sharded, even
// when they reuse the memory of the old shards (the shard registry must not mistake them for
// shards of a child unit and leave them whole).
TEST(FullyShard, ModelsShardedOneAfterAnotherAreEachShardedWhole) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    for (int round = 0; round < 8; ++round) {
      SCOPED_TRACE("round " + std::to_string(round));
      Transformer model(tiny());
      std::vector<int64_t> rows;
      for (const auto& p : model->parameters()) rows.push_back(p.size(0));
      shard_model(*model, mesh);
      size_t i = 0;
      for (const auto& p : model->parameters()) {
        ASSERT_TRUE(fsdp::is_fsdp_shard(p));
        EXPECT_EQ(fsdp::shard_info(p).full_rows, rows[i]);
        EXPECT_EQ(p.size(0), (rows[i] + 1) / 2 - (mesh.get_local_rank() == 1 ? rows[i] % 2 : 0));
        ++i;
      }
    }
  });
}
