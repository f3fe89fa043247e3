// DeviceMesh: layout, coordinates, per-dimension groups, slicing and its errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

TEST(DeviceMesh, TwoByTwoMeshHasRowMajorCoordinatesAndLocalRanks) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    EXPECT_EQ(mesh.ndim(), 2);
    EXPECT_EQ(mesh.size(), 4);
    EXPECT_EQ(mesh.size(1), 2);
    EXPECT_EQ(*mesh.coordinate(), (std::vector<int64_t>{rank / 2, rank % 2}));
    EXPECT_EQ(mesh.get_local_rank("dp"), rank / 2);
    EXPECT_EQ(mesh.get_local_rank("tp"), rank % 2);
    EXPECT_EQ(mesh.str(), "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))");
    EXPECT_EQ(mesh.device(), at::Device(at::kCPU));
  });
}

TEST(DeviceMesh, EachDimensionGroupReducesOverItsRow) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto x = at::full({1}, static_cast<double>(rank), at::kDouble);
    // tp groups are [0,1] and [2,3]; dp groups are [0,2] and [1,3].
    auto tp = comm::all_reduce(x, ReduceOp::Sum, mesh.group(1)).item<double>();
    auto dp = comm::all_reduce(x, ReduceOp::Sum, mesh.group(0)).item<double>();
    EXPECT_EQ(tp, rank < 2 ? 1.0 : 5.0);
    EXPECT_EQ(dp, rank % 2 == 0 ? 2.0 : 4.0);
    EXPECT_EQ(mesh.get_group("tp")->global_ranks(),
              (std::vector<int>{rank < 2 ? 0 : 2, rank < 2 ? 1 : 3}));
    EXPECT_EQ(mesh.group(0).mesh_dim(), 0);
    EXPECT_EQ(mesh.group(1).mesh_dim(), 1);
  });
}

TEST(DeviceMesh, SlicesReuseTheParentGroups) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto tp = mesh["tp"];
    EXPECT_EQ(tp.ndim(), 1);
    EXPECT_EQ(tp.ranks(), (std::vector<int64_t>{rank < 2 ? 0 : 2, rank < 2 ? 1 : 3}));
    EXPECT_EQ(tp.get_group(0).get(), mesh.get_group(1).get());
    auto dp = mesh["dp"];
    EXPECT_EQ(dp.ranks(), (std::vector<int64_t>{rank % 2, rank % 2 + 2}));
    EXPECT_EQ(dp.get_local_rank(), rank / 2);
    EXPECT_EQ(mesh.slice({"dp", "tp"}), mesh);
    // A DTensor on the slice communicates over the parent's tp group.
    auto dt = distribute_tensor(at::arange(4, at::kFloat), tp, {Shard(0)});
    EXPECT_EQ(full_tensor(dt).sum().item<float>(), 6.0f);
  });
}

// concatenate joins slices of one mesh in any order, on the parent's groups: (tp, dp) lays
// a tensor out over tp first, then over dp within each tp part.
TEST(DeviceMesh, ConcatenatedSlicesTakeAnyOrderOnTheParentGroups) {
  run_ranks(8, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2, 2}, {"pp", "dp", "tp"});
    auto tp_dp = DeviceMesh::concatenate({mesh["tp"], mesh["dp"]});
    EXPECT_EQ(tp_dp.dim_names(), (std::vector<std::string>{"tp", "dp"}));
    EXPECT_EQ(tp_dp.shape(), (std::vector<int64_t>{2, 2}));
    const int64_t base = rank / 4 * 4;  // this rank's pp stage
    EXPECT_EQ(tp_dp.ranks(), (std::vector<int64_t>{base, base + 2, base + 1, base + 3}));
    EXPECT_EQ(*tp_dp.coordinate(), (std::vector<int64_t>{rank % 2, rank / 2 % 2}));
    EXPECT_EQ(tp_dp.get_group(0).get(), mesh.get_group(2).get());
    EXPECT_EQ(tp_dp.get_group(1).get(), mesh.get_group(1).get());
    // A slice of a slice still knows the mesh it came from.
    EXPECT_EQ(DeviceMesh::concatenate({mesh.slice({"dp", "tp"})["tp"], mesh["pp"]}).ranks(),
              (std::vector<int64_t>{rank % 4 / 2 * 2, rank % 4 / 2 * 2 + 4, rank % 4 / 2 * 2 + 1,
                                    rank % 4 / 2 * 2 + 5}));
    // Shard(0) twice: tp's chunk, then dp's chunk of it (rows 2t + d of 4).
    auto dt = distribute_tensor(at::arange(4, at::kFloat), tp_dp, {Shard(0), Shard(0)});
    EXPECT_EQ(local_tensor(dt).item<float>(), static_cast<float>(rank % 2 * 2 + rank / 2 % 2));
    EXPECT_TRUE(at::equal(full_tensor(dt), at::arange(4, at::kFloat)));
    EXPECT_ERROR(DeviceMesh::concatenate({mesh["tp"], mesh.slice({"dp", "tp"})}), c10::Error,
                 "appears twice");
    auto other = init_device_mesh("cpu", {4, 2}, {"dp", "tp"});
    EXPECT_ERROR(DeviceMesh::concatenate({other["tp"], mesh["dp"]}), c10::Error,
                 "are not slices of one mesh");
  });
}

TEST(DeviceMesh, ConstructionAndSlicingErrorsSayWhatIsWrong) {
  run_ranks(2, [](int) {
    EXPECT_ERROR(init_device_mesh("cpu", {2}, {"a", "b"}), c10::Error,
                 "mesh_shape and mesh_dim_names should have same length!");
    EXPECT_ERROR(init_device_mesh("cpu", {1, 2}, {"a", "a"}), c10::Error,
                 "Each mesh_dim_name must be unique.");
    EXPECT_ERROR(init_device_mesh("cuda:0", {2}), c10::Error,
                 "Device type with index is not supported");
    EXPECT_ERROR(init_device_mesh("cpu", {4}), c10::Error, "needs 4 ranks");
    auto plain = init_device_mesh("cpu", {2});
    EXPECT_ERROR(plain["tp"], c10::Error, "Cannot slice a DeviceMesh without mesh_dim_names!");
    auto mesh = init_device_mesh("cpu", {1, 2}, {"dp", "tp"});
    EXPECT_ERROR(mesh["pp"], c10::IndexError, "Valid mesh_dim_names: ('dp', 'tp')");
    EXPECT_ERROR(mesh.slice({"tp", "dp"}), c10::IndexError, "ascending order");
    EXPECT_ERROR(mesh.get_local_rank(), c10::Error, "needs to be specified");
  });
}

TEST(DeviceMesh, MeshGuardProvidesTheDefaultMesh) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    EXPECT_FALSE(current_mesh().has_value());
    EXPECT_ERROR(from_local(at::ones({2})), c10::Error, "No device mesh is currently active!");
    {
      MeshGuard g(mesh);
      auto dt = from_local(at::ones({2}), std::vector<Placement>{Shard(0)});
      EXPECT_EQ(dt.sizes(), at::IntArrayRef({4}));
      EXPECT_EQ(device_mesh(dt), mesh);
    }
    EXPECT_FALSE(current_mesh().has_value());
  });
}

TEST(DeviceMesh, SingleRankMeshWorksWithoutPeers) {
  run_ranks(1, [](int) {
    auto mesh = init_device_mesh("cpu", {1});
    auto dt = distribute_tensor(at::arange(5, at::kFloat), mesh, {Shard(0)});
    EXPECT_TENSOR_EQ(full_tensor(redistribute(dt, {Replicate()})), at::arange(5, at::kFloat));
  });
}
