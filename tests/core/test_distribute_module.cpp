// distribute_module swaps parameters in the registry and in the layers' public members.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

TEST(DistributeModule, PartitionFnShardsAndTheRestIsReplicatedFromRankZero) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::manual_seed(100 + rank);  // ranks start with different weights
    torch::nn::Linear fc(4, 6);
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({6}));
    auto seq = torch::nn::Sequential(fc, norm);
    const at::Tensor w0 = fc->weight.detach().clone();
    distribute_module(*seq, mesh,
                      [](const std::string& name, torch::nn::Module& m, const DeviceMesh& mesh) {
                        if (name != "0") return;
                        auto& lin = dynamic_cast<torch::nn::LinearImpl&>(m);
                        replace_parameter(lin, "weight",
                                          distribute_tensor(lin.weight.detach(), mesh, {Shard(0)}));
                      });
    // Registry and member point at the same DTensor.
    EXPECT_TRUE(is_dtensor(fc->weight));
    EXPECT_TRUE(fc->weight.is_same(fc->named_parameters()["weight"]));
    EXPECT_TRUE(fc->weight.requires_grad());
    EXPECT_EQ(placements(fc->weight)[0], Shard(0));
    EXPECT_EQ(placements(fc->bias)[0], Replicate());
    EXPECT_EQ(placements(norm->weight)[0], Replicate());
    EXPECT_TRUE(norm->bias.is_same(norm->named_parameters()["bias"]));
    // Everything came from rank 0: gathered weights equal rank 0's original ones.
    auto gathered = full_tensor(fc->weight.detach());
    auto from0 = comm::broadcast(w0, 0, *comm::world_group());
    EXPECT_TENSOR_EQ(gathered, from0);
    for (const auto& p : seq->parameters()) EXPECT_TRUE(is_dtensor(p));
    EXPECT_ERROR(distribute_module(*seq, mesh), c10::Error,
                 "distribute_module should only be called once on a module");
  });
}

TEST(DistributeModule, ReplaceParameterNamesTheMissingParameter) {
  run_ranks(1, [](int) {
    torch::nn::Linear fc(2, 2);
    EXPECT_ERROR(replace_parameter(*fc, "wieght", at::ones({2, 2})), c10::Error,
                 "no parameter 'wieght'", "weight, bias");
  });
}
