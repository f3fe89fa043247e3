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

// The backward of a value-selecting reduction scatters the gradient into zeros of the input's
// size; decomposed above the kernel those zeros were a plain tensor, so x.grad() came back as a
// plain [3, 8] tensor (right values, whole on every rank) instead of a DTensor.
TEST(Reduction, GradientThroughValueSelectingReductionsIsADTensorOnTheLeafMesh) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::manual_seed(5);
    const auto g = at::randn({3, 8}, at::kDouble);
    using Fn = std::function<at::Tensor(const at::Tensor&)>;
    const std::vector<std::pair<std::string, Fn>> ops = {
        {"max(x, 1)", [](const at::Tensor& x) { return std::get<0>(at::max(x, 1)); }},
        {"min(x, 1, keepdim)",
         [](const at::Tensor& x) { return std::get<0>(at::min(x, 1, true)); }},
        {"max(x, 0)", [](const at::Tensor& x) { return std::get<0>(at::max(x, 0)); }},
        {"sort(x, 1)", [](const at::Tensor& x) { return std::get<0>(x.sort(1)); }},
        {"topk(x, 3, 1)", [](const at::Tensor& x) { return std::get<0>(x.topk(3, 1)); }},
        {"topk(x, 2, 0)", [](const at::Tensor& x) { return std::get<0>(x.topk(2, 0)); }},
    };
    for (const auto& [name, fn] : ops) {
      for (const Placements& p : std::vector<Placements>{{Shard(1)}, {Shard(0)}, {Replicate()}}) {
        SCOPED_TRACE(name + " on " + to_string(p));
        auto ref = g.clone().requires_grad_(true);
        (fn(ref) * at::arange(1, fn(ref).numel() + 1, at::kDouble).view(fn(ref).sizes()))
            .sum()
            .backward();
        auto x = distribute_tensor(g, mesh, p).requires_grad_(true);
        auto y = fn(x);
        auto w = distribute_tensor(at::arange(1, y.numel() + 1, at::kDouble).view(y.sizes()), mesh,
                                   {Replicate()});
        (y * w).sum().backward();
        ASSERT_TRUE(x.grad().defined());
        ASSERT_TRUE(is_dtensor(x.grad())) << "plain gradient " << x.grad().sizes();
        EXPECT_EQ(device_mesh(x.grad()), mesh);
        EXPECT_TENSOR_CLOSE(full_tensor(x.grad()), ref.grad());
      }
    }
  });
}

// A 0-d tensor's dim 0 (or -1) is the tensor itself: reducing over it used to write past the
// end of the rule's per-dim table (a crash found by the OpInfo sweep: sum, amax, mean,
// linalg_vector_norm of a 0-d DTensor with dim=0).
TEST(Reduction, OverDimZeroOfAZeroDimTensor) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto g = at::scalar_tensor(-3.5, at::kDouble);
    auto dt = distribute_tensor(g, mesh, {Replicate()});
    for (int64_t dim : {0, -1}) {
      EXPECT_TENSOR_EQ(full_tensor(dt.sum({dim})), g.sum({dim}));
      EXPECT_TENSOR_EQ(full_tensor(dt.amax({dim}, true)), g.amax({dim}, true));
      EXPECT_TENSOR_EQ(full_tensor(dt.mean({dim})), g.mean({dim}));
      EXPECT_TENSOR_EQ(full_tensor(at::linalg_vector_norm(dt, 2, {dim})),
                       at::linalg_vector_norm(g, 2, {dim}));
    }
  });
}
