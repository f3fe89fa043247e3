// DTensor factories: shards only, and random values that do not depend on the layout.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

TEST(Factories, ConstantFactoriesAllocateOnlyTheLocalShard) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    auto z = zeros({10, 3}, mesh, {Shard(0)});
    EXPECT_EQ(z.sizes(), at::IntArrayRef({10, 3}));
    EXPECT_EQ(local_tensor(z).size(0), rank < 3 ? 3 : 1);
    EXPECT_TENSOR_EQ(full_tensor(ones({5, 2}, mesh, {Shard(1)}, at::kDouble)),
                     at::ones({5, 2}, at::kDouble));
    EXPECT_TENSOR_EQ(full_tensor(full({3}, 2.5, mesh, {Replicate()})), at::full({3}, 2.5));
    EXPECT_EQ(empty({8}, mesh, {Shard(0)}).sizes(), at::IntArrayRef({8}));
    auto g = ones({4}, mesh, {Shard(0)}, at::TensorOptions().requires_grad(true));
    EXPECT_TRUE(g.requires_grad());
    EXPECT_TRUE(g.is_leaf());
    EXPECT_ERROR(zeros({4}, mesh, {Partial()}), c10::Error,
                 "cannot create a Partial DTensor; use from_local");
  });
}

TEST(Factories, RandomValuesDoNotDependOnPlacementsAndMatchOneDevice) {
  run_ranks(4, [](int) {
    auto mesh2 = init_device_mesh("cpu", {2, 2});
    auto mesh1 = init_device_mesh("cpu", {4});
    const std::vector<int64_t> size{7, 5};
    for (bool normal : {false, true}) {
      auto draw = [&](const DeviceMesh& m, const Placements& p) {
        manual_seed(42);
        return normal ? randn(size, m, p, at::kDouble) : rand(size, m, p, at::kDouble);
      };
      manual_seed(42);
      auto reference = normal ? randn_global(size, at::kDouble) : rand_global(size, at::kDouble);
      for (const auto& p : {Placements{Shard(0)}, Placements{Shard(1)}, Placements{Replicate()}}) {
        EXPECT_TENSOR_EQ(full_tensor(draw(mesh1, p)), reference);
      }
      for (const auto& p : {Placements{Shard(0), Shard(1)}, Placements{Replicate(), Shard(0)},
                            Placements{Shard(1), Shard(1)}}) {
        EXPECT_TENSOR_EQ(full_tensor(draw(mesh2, p)), reference);
      }
    }
  });
}

TEST(Factories, ShardsDrawDisjointValuesAndReplicasEqualOnes) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    manual_seed(1);
    auto x = rand({4, 4}, mesh, {Shard(0), Replicate()});
    // Ranks with the same dp coordinate hold the same rows; the two halves differ.
    auto mine = local_tensor(x);
    auto all = comm::all_gather_into_tensor(mine.unsqueeze(0), 0, *comm::world_group());
    EXPECT_TRUE(at::equal(all[0], all[1]));
    EXPECT_TRUE(at::equal(all[2], all[3]));
    EXPECT_FALSE(at::equal(all[0], all[2]));
    // Consecutive draws continue the stream: no repeated values.
    auto y = rand({4, 4}, mesh, {Shard(0), Replicate()});
    EXPECT_FALSE(at::equal(local_tensor(x), local_tensor(y)));
    // Uniform statistics are sane.
    manual_seed(3);
    auto big = full_tensor(randn({200, 50}, mesh, {Shard(0), Shard(1)}, at::kDouble));
    EXPECT_NEAR(big.mean().item<double>(), 0.0, 0.05);
    EXPECT_NEAR(big.std().item<double>(), 1.0, 0.05);
  });
}
