// Collectives issued from op kernels go through ops::kernel_all_reduce: reductions over the
// listed mesh dims match a one-device sum, CommDebugMode counts them like any collective
// (equal() on shards issues exactly one per sharded mesh dim), and errors name the op.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "dtensor/ops/kernel_collectives.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::testing;

TEST(KernelCollectives, ReduceOverListedMeshDimsAndCount) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    const at::Tensor mine = at::full({3}, static_cast<double>(rank + 1), at::kDouble);
    CommDebugMode comm;
    const at::Tensor none =
        ops::kernel_all_reduce("test::op", mine, ReduceOp::Sum, mesh, c10::ArrayRef<int64_t>{});
    EXPECT_EQ(comm.get_total_counts(), 0);
    EXPECT_TRUE(at::equal(none, mine));
    const at::Tensor all =
        ops::kernel_all_reduce("test::op", mine, ReduceOp::Sum, mesh, std::vector<int64_t>{0, 1});
    EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 2}})) << comm.table();
    EXPECT_TRUE(at::equal(all, at::full({3}, 1.0 + 2 + 3 + 4, at::kDouble)));
    // Mesh dim 1 pairs ranks {0, 1} and {2, 3} (row-major).
    const at::Tensor row = ops::kernel_all_reduce("test::op", mine, ReduceOp::Max, mesh, 1);
    EXPECT_TRUE(at::equal(row, at::full({3}, rank < 2 ? 2.0 : 4.0, at::kDouble)));
  });
}

TEST(KernelCollectives, AOneRankMeshDimIssuesNoCollective) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 1});
    const at::Tensor mine = at::full({3}, static_cast<double>(rank + 1), at::kDouble);
    CommDebugMode comm;
    EXPECT_TRUE(at::equal(ops::kernel_all_reduce("test::op", mine, ReduceOp::Sum, mesh, 1), mine));
    EXPECT_EQ(comm.get_total_counts(), 0);
    const at::Tensor both =
        ops::kernel_all_reduce("test::op", mine, ReduceOp::Sum, mesh, std::vector<int64_t>{0, 1});
    EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 1}})) << comm.table();
    EXPECT_TRUE(at::equal(both, at::full({3}, 3.0, at::kDouble)));
  });
}

TEST(KernelCollectives, EqualOnShardsIssuesOneAllReducePerShardedMeshDim) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    at::manual_seed(3);
    const at::Tensor x = at::rand({8, 6}, at::kDouble);
    at::Tensor y = x.clone();
    y[7][5] = -1;  // differs in the shard of the last rank only
    const auto dx = distribute_tensor(x, mesh, {Shard(0), Shard(1)});
    const auto dy = distribute_tensor(y, mesh, {Shard(0), Shard(1)});
    CommDebugMode comm;
    EXPECT_TRUE(at::equal(dx, dx));
    EXPECT_FALSE(at::equal(dx, dy));  // every rank, not only the one holding the difference
    EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 4}})) << comm.table();
  });
}

TEST(KernelCollectives, ErrorsNameTheOpAndMeshDim) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor t = at::ones({2});
    const std::string msg =
        message_of([&] { ops::kernel_all_reduce("aten::equal", t, ReduceOp::Sum, mesh, 1); });
    EXPECT_CONTAINS(msg, "in the local kernel of aten::equal");
    EXPECT_CONTAINS(msg, "mesh dim 1");
  });
}
