// parallelize_module checks that every rank applies the same plan to the same model structure
// over the same mesh (one all_gather of a hash); on a difference every rank fails before
// anything changes, naming the first difference.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::testing;
using namespace dtensor::tp;

namespace {

struct MLPImpl : dtensor::nn::Module {
  explicit MLPImpl(int64_t hidden = 16) {
    net1 = register_module("net1", dtensor::nn::Linear(10, hidden));
    net2 = register_module("net2", dtensor::nn::Linear(hidden, 10));
  }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& t) { return net2(net1(t).relu()); }, x);
  }
  dtensor::nn::Linear net1{nullptr}, net2{nullptr};
};
TORCH_MODULE(MLP);

ParallelizePlan megatron() { return {{"net1", ColwiseParallel()}, {"net2", RowwiseParallel()}}; }

// Runs parallelize_module on 2 ranks, rank 1 with its own plan, model or mesh names, and
// checks that both ranks fail with `expected` and leave the model untouched.
void expect_mismatch(const ParallelizePlan& plan1, int64_t hidden1, at::ScalarType dtype1,
                     std::vector<std::string> mesh_names1,
                     const std::vector<std::string>& expected) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2}, rank == 1 ? mesh_names1 : std::vector<std::string>{});
    MLP model(rank == 1 ? hidden1 : 16);
    model->to(rank == 1 ? dtype1 : at::kDouble);
    std::vector<std::string> parts{"parallelize_module: rank 1 differs from rank 0"};
    parts.insert(parts.end(), expected.begin(), expected.end());
    EXPECT_ERROR(parallelize_module(*model, mesh, rank == 1 ? plan1 : megatron()), c10::Error,
                 parts);
    for (const auto& p : model->parameters()) EXPECT_FALSE(is_dtensor(p));
    EXPECT_EQ(model->net1->num_hooks(), 0u);
  });
}

}  // namespace

TEST(PlanConsistency, SamePlanCostsOneAllGather) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    MLP model;
    CommDebugMode comm;
    parallelize_module(*model, mesh, megatron());
    comm.exit();
    // The check's one all_gather, then the parameters: 3 Shard scatters, 1 bias broadcast.
    EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_gather_into_tensor, 1},
                                                  {CommType::scatter, 3},
                                                  {CommType::broadcast, 1}}))
        << comm.table();
  });
}

TEST(PlanConsistency, DifferentStyleForAKey) {
  expect_mismatch(
      {{"net1", RowwiseParallel()}, {"net2", RowwiseParallel()}}, 16, at::kDouble, {},
      {"at plan key 'net1': ColwiseParallel(", "on rank 0 vs RowwiseParallel(", "on rank 1"});
}

TEST(PlanConsistency, DifferentKeys) {
  expect_mismatch({{"net*", ColwiseParallel()}, {"net2", RowwiseParallel()}}, 16, at::kDouble, {},
                  {"plan key 'net1'", "plan key 'net*'"});
}

TEST(PlanConsistency, DifferentParameterShape) {
  expect_mismatch(megatron(), 18, at::kDouble, {},
                  {"at parameter 'net1.weight' shape: [16, 10] on rank 0 vs [18, 10] on rank 1"});
}

TEST(PlanConsistency, DifferentParameterDtype) {
  expect_mismatch(megatron(), 16, at::kFloat, {},
                  {"at parameter 'net1.weight' dtype: Double on rank 0 vs Float on rank 1"});
}

TEST(PlanConsistency, DifferentMesh) {
  expect_mismatch(megatron(), 16, at::kDouble, {"tp"},
                  {"at mesh: DeviceMesh('cpu', [0, 1]) on rank 0 vs DeviceMesh('cpu', [0, 1], "
                   "mesh_dim_names=('tp',)) on rank 1"});
}
