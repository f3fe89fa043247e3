// Reductions on DTensors: results must equal the single-device reduction for every layout,
// including a tensor dim sharded over several mesh dims with uneven or empty shards.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using dtensor::testing::message_of;
using dtensor::testing::run_ranks;

TEST(Reduction, MeanOverDimShardedOnTwoMeshDimsWithUnevenShards) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    for (int64_t n : {6, 2, 5, 1, 3}) {
      auto g = at::arange(1, n + 1, at::kDouble);
      auto dt = distribute_tensor(g, mesh, {Shard(0), Shard(0)});
      EXPECT_TENSOR_CLOSE(full_tensor(dt.mean()), g.mean(), 1e-12, 1e-12);
      EXPECT_TENSOR_CLOSE(full_tensor(dt.mean(0, true)), g.mean(0, true), 1e-12, 1e-12);
      EXPECT_TENSOR_CLOSE(full_tensor(dt.amax(0)), g.amax(0));
      EXPECT_TENSOR_CLOSE(full_tensor(dt.max()), g.max());
      EXPECT_TENSOR_CLOSE(full_tensor(dt.min()), g.min());
      EXPECT_TENSOR_CLOSE(full_tensor(dt.prod()), g.prod(), 1e-12, 0);
      EXPECT_TENSOR_CLOSE(full_tensor(dt.sum()), g.sum());
      EXPECT_TENSOR_CLOSE(full_tensor(at::linalg_vector_norm(dt, INFINITY)),
                          at::linalg_vector_norm(g, INFINITY));
    }
  });
}

TEST(Reduction, MaxDimAndMinDimGiveValuesAndGlobalIndices) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    at::manual_seed(3);
    auto g = at::randn({5, 3}, at::kDouble);
    for (const Placements& p : std::vector<Placements>{{Replicate(), Replicate()},
                                                       {Shard(0), Shard(0)},
                                                       {Shard(0), Shard(1)},
                                                       {Shard(1), Replicate()}}) {
      auto dt = distribute_tensor(g, mesh, p);
      for (int64_t d : {0, 1}) {
        for (bool keep : {false, true}) {
          auto [v, i] = at::max(dt, d, keep);
          auto [rv, ri] = at::max(g, d, keep);
          EXPECT_TENSOR_EQ(full_tensor(v), rv);
          EXPECT_TENSOR_EQ(full_tensor(i), ri);
          auto [mv, mi] = at::min(dt, d, keep);
          auto [rmv, rmi] = at::min(g, d, keep);
          EXPECT_TENSOR_EQ(full_tensor(mv), rmv);
          EXPECT_TENSOR_EQ(full_tensor(mi), rmi);
          EXPECT_TENSOR_EQ(full_tensor(at::argmax(dt, d, keep)), at::argmax(g, d, keep));
          EXPECT_TENSOR_EQ(full_tensor(at::argmin(dt, d, keep)), at::argmin(g, d, keep));
        }
      }
      EXPECT_TENSOR_EQ(full_tensor(at::argmax(dt)), at::argmax(g));
      EXPECT_TENSOR_EQ(full_tensor(at::argmin(dt)), at::argmin(g));
    }
  });
}

// A Partial(avg) meeting a Partial(sum) (a mean added to a pending sum, a linear layer on a
// pending mean) is reduced and re-partitioned instead of failing.
TEST(Reduction, PartialAvgMeetsPartialSum) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::manual_seed(5);
    auto x = at::randn({4, 3}, at::kDouble);
    auto y = at::randn({3}, at::kDouble);
    auto w = at::randn({2, 3}, at::kDouble);
    auto dx = distribute_tensor(x, mesh, {Shard(0)});
    auto pending_mean = dx.mean(0);  // Partial(avg)
    ASSERT_EQ(placements(pending_mean)[0], Partial(ReduceOp::Avg));
    // y as a pending sum: rank 0 holds y, rank 1 zeros
    auto dy = from_local(rank == 0 ? y : at::zeros_like(y), mesh, {Partial()});
    EXPECT_TENSOR_CLOSE(full_tensor(pending_mean + dy), x.mean(0) + y, 1e-12, 1e-12);
    auto dw = distribute_tensor(w, mesh, {Replicate()});
    EXPECT_TENSOR_CLOSE(full_tensor(at::linear(pending_mean.unsqueeze(0), dw)),
                        at::linear(x.mean(0).unsqueeze(0), w), 1e-12, 1e-12);
  });
}
