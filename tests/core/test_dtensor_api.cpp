// from_local / to_local / full_tensor / distribute_tensor semantics
// (docs/ARCHITECTURE.md, "DTensor API semantics"), each compared with a single-device computation
// from the same seed.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include "dtensor/dtensor.h"
#include "support/comm_counts.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using dtensor::testing::counts;
using dtensor::testing::run_ranks;

TEST(FromLocal, ShardZeroGivesGlobalRowsAndReplicateKeepsShape) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    auto local = at::randn({3, 3});
    auto s = from_local(local, mesh, {Shard(0)});
    EXPECT_EQ(s.sizes(), at::IntArrayRef({12, 3}));
    EXPECT_TRUE(is_dtensor(s));
    EXPECT_EQ(s.device(), at::Device(at::kCPU));
    auto r = from_local(local, mesh, {Replicate()});
    EXPECT_EQ(r.sizes(), at::IntArrayRef({3, 3}));
    auto p = from_local(local, mesh, {Partial()});
    EXPECT_EQ(p.sizes(), at::IntArrayRef({3, 3}));
    auto neg = from_local(local, mesh, {Shard(-1)});
    EXPECT_EQ(placements(neg)[0], Shard(1));
    EXPECT_EQ(neg.sizes(), at::IntArrayRef({3, 12}));
  });
}

TEST(FromLocal, GlobalStrideFollowsLocalLayout) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto a = from_local(at::randn({8, 4}), mesh, {Shard(1)});
    EXPECT_EQ(a.strides(), at::IntArrayRef({16, 1}));
    auto b = from_local(at::randn({8, 32, 1}).permute({0, 2, 1}), mesh, {Shard(1)});
    EXPECT_EQ(b.sizes(), at::IntArrayRef({8, 4, 32}));
    EXPECT_EQ(b.strides(), at::IntArrayRef({128, 1, 4}));
  });
}

TEST(FromLocal, UnevenShardsNeedShapeAndStrideTogether) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    const int64_t rows = rank < 3 ? 3 : 1;  // 10 rows on 4 ranks: 3,3,3,1
    auto local = at::ones({rows, 2});
    auto dt =
        from_local(local, mesh, {Shard(0)},
                   {.shape = std::vector<int64_t>{10, 2}, .stride = std::vector<int64_t>{2, 1}});
    EXPECT_EQ(dt.sizes(), at::IntArrayRef({10, 2}));
    EXPECT_TENSOR_EQ(full_tensor(dt), at::ones({10, 2}));
    EXPECT_ERROR(from_local(local, mesh, {Shard(0)}, {.shape = std::vector<int64_t>{10, 2}}),
                 c10::Error, "Please pass both shape and stride at the same time.");
  });
}

TEST(FromLocal, GradientFlowsThroughNonLeafLocal) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = at::ones({3, 3}).requires_grad_(true);
    auto y = x * 3;  // non-leaf
    auto dt = from_local(y, mesh, {Replicate()});
    EXPECT_TRUE(dt.requires_grad());
    EXPECT_FALSE(dt.is_leaf());
    auto z = to_local(dt * 3);
    z.sum().backward();
    EXPECT_TENSOR_EQ(x.grad(), at::full({3, 3}, 9.0));
  });
}

TEST(FromLocal, RunCheckRejectsDifferentDtypeOnOneRank) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto local = rank == 0 ? at::ones({2, 2}, at::kFloat) : at::ones({2, 2}, at::kDouble);
    EXPECT_ERROR(from_local(local, mesh, {Replicate()}, {.run_check = true}), c10::ValueError,
                 "Inconsistent tensor metadata");
  });
}

// Local rows 3 then 4 under a declared shape [7, 4]: torch.chunk gives 4 then 3, so the
// layout is inconsistent and every rank must fail, naming the rank and both shapes.
TEST(FromLocal, RunCheckRejectsLocalSizesThatDisagreeWithTheDeclaredShape) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto local = at::ones({rank == 0 ? 3 : 4, 4});
    EXPECT_ERROR(from_local(local, mesh, {Shard(0)},
                            {.run_check = true,
                             .shape = std::vector<int64_t>{7, 4},
                             .stride = std::vector<int64_t>{4, 1}}),
                 c10::ValueError, "Inconsistent tensor metadata", "rank 0 has local shape [3, 4]",
                 "expected [4, 4]");
    // The matching layout is accepted and gathers back to the rows given.
    auto ok = at::arange(28, at::kFloat).reshape({7, 4});
    auto mine = rank == 0 ? ok.narrow(0, 0, 4) : ok.narrow(0, 4, 3);
    auto dt = from_local(mine.clone(), mesh, {Shard(0)},
                         {.run_check = true,
                          .shape = std::vector<int64_t>{7, 4},
                          .stride = std::vector<int64_t>{4, 1}});
    EXPECT_TENSOR_EQ(full_tensor(dt), ok);
  });
}

TEST(FromLocal, RunCheckRejectsDifferentNdimAndNamesTheRanks) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto local = rank == 0 ? at::ones({2, 2}) : at::ones({4});
    EXPECT_ERROR(from_local(local, mesh, {Replicate()}, {.run_check = true}), c10::ValueError,
                 "Inconsistent tensor metadata", "rank 1");
  });
}

TEST(FromLocal, RunCheckBroadcastsReplicasFromFirstRank) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto dt = from_local(at::full({2}, static_cast<double>(rank + 7)), mesh, {Replicate()},
                         {.run_check = true});
    EXPECT_TENSOR_EQ(local_tensor(dt), at::full({2}, 7.0, at::kFloat));
    // The gradient still reaches the caller's local tensor.
    auto x = at::full({2}, static_cast<double>(rank + 7)).requires_grad_(true);
    auto y = from_local(x, mesh, {Replicate()}, {.run_check = true});
    EXPECT_TENSOR_EQ(local_tensor(y), at::full({2}, 7.0, at::kFloat));
    to_local(y * 3).sum().backward();
    EXPECT_TENSOR_EQ(x.grad(), at::full({2}, 3.0));
  });
}

TEST(ToLocal, WithoutGradModeReturnsTheSameLocalObject) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto dt = from_local(at::randn({2, 2}), mesh, {Shard(0)});
    at::NoGradGuard ng;
    auto a = to_local(dt);
    auto b = to_local(dt);
    EXPECT_TRUE(a.is_same(b));
  });
}

TEST(ToLocal, GradPlacementsPartialAfterGatherGivesReduceScatterInBackward) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto x = at::randn({3, 3}).requires_grad_(true);
    auto dt = from_local(x, mesh, {Shard(0)});
    CommDebugMode comm;
    auto r = redistribute(dt, {Replicate()});
    auto local = to_local(r, std::vector<Placement>{Partial()});
    local.sum().backward();
    EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::all_gather_into_tensor, 1},
                                              {CommType::reduce_scatter_tensor, 1}}));
    // Every rank's ones are summed: 4 * ones for this rank's rows.
    EXPECT_TENSOR_EQ(x.grad(), at::full({3, 3}, 4.0));
  });
}

// A weak reference to a dead DTensor keeps its TensorImpl object, not its local shard: FSDP's
// shard registry holds its leaves weakly, and each model planned in one process kept the last
// one's shards alive until the next fully_shard (a plan after another saw them freed).
TEST(DTensorImpl, AWeakReferenceDoesNotKeepTheLocalShard) {
  run_ranks(1, [](int) {
    auto mesh = init_device_mesh("cpu", {1});
    at::Tensor local = at::ones({4});
    c10::weak_intrusive_ptr<c10::TensorImpl> local_alive(local.getIntrusivePtr());
    at::Tensor dt = make_dtensor(std::move(local),
                                 make_spec(mesh, {Shard(0)}, TensorMeta{{4}, {1}, at::kFloat}));
    c10::weak_intrusive_ptr<c10::TensorImpl> weak_dt(dt.getIntrusivePtr());
    ASSERT_FALSE(local_alive.expired());
    dt = at::Tensor();
    EXPECT_TRUE(weak_dt.expired());
    EXPECT_TRUE(local_alive.expired()) << "the dead DTensor still holds its local shard";
  });
}

TEST(FullTensor, ReassemblesShardsAndIsNotPending) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    at::manual_seed(0);
    auto global = at::randn({8, 6});
    auto dt = distribute_tensor(global, mesh, {Shard(1)});
    // 6 columns on 4 ranks: 2,2,2,0 (torch.chunk gives only 3 chunks; the last rank is empty)
    auto expected = rank < 3 ? global.narrow(1, 2 * rank, 2) : global.narrow(1, 6, 0);
    EXPECT_TENSOR_EQ(local_tensor(dt), expected);
    auto full = full_tensor(dt);
    EXPECT_FALSE(is_dtensor(full));
    EXPECT_TENSOR_EQ(full, global);
  });
}

TEST(DistributeTensor, ScattersFromSourceRankAndKeepsLeafness) {
  run_ranks(3, [](int rank) {
    auto mesh = init_device_mesh("cpu", {3});
    // Each rank starts with different data; rank 1's copy must win.
    auto t = at::full({7, 2}, static_cast<double>(rank), at::kDouble).requires_grad_(true);
    CommDebugMode comm;
    auto dt = distribute_tensor(t, mesh, {Shard(0)}, 1);
    EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::scatter, 1}}));
    EXPECT_TRUE(dt.is_leaf());
    EXPECT_TRUE(dt.requires_grad());
    EXPECT_TENSOR_EQ(full_tensor(dt.detach()), at::full({7, 2}, 1.0, at::kDouble));
    const int64_t rows = rank < 2 ? 3 : 1;
    EXPECT_EQ(local_tensor(dt).size(0), rows);
  });
}

TEST(DistributeTensor, WithoutSourceRankEveryRankKeepsItsOwnDataWithoutCommunication) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto t = at::full({4}, static_cast<double>(rank));
    CommDebugMode comm;
    auto dt = distribute_tensor(t, mesh, {Replicate()}, std::nullopt);
    EXPECT_EQ(comm.get_total_counts(), 0);
    EXPECT_TENSOR_EQ(local_tensor(dt), t);
  });
}

TEST(DistributeTensor, RejectsNonLeafPartialAndWrongPlacementCount) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto leaf = at::ones({4}).requires_grad_(true);
    auto non_leaf = leaf * 2;
    EXPECT_ERROR(distribute_tensor(non_leaf, mesh, {Replicate()}), c10::Error,
                 "should be used to distribute leaf tensors");
    EXPECT_ERROR(distribute_tensor(at::ones({4}), mesh, {Partial()}), c10::Error,
                 "Partial cannot be distributed");
    EXPECT_ERROR(distribute_tensor(at::ones({4}), mesh, {Replicate(), Replicate()}),
                 c10::ValueError, "must have the same length as `device_mesh.ndim`");
  });
}

TEST(Redistribute, RejectsPartialTargetAndOtherMeshes) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto other = init_device_mesh("cpu", {2}, {"x"});
    auto dt = distribute_tensor(at::ones({4}), mesh, {Shard(0)});
    EXPECT_ERROR(redistribute(dt, {Partial()}), c10::Error, "Can not redistribute to Partial");
    EXPECT_ERROR(redistribute(dt, other, {Replicate()}), c10::NotImplementedError,
                 "Cross device mesh comm not supported yet!");
    EXPECT_ERROR(redistribute(dt, {Replicate(), Replicate()}), c10::ValueError,
                 "must have the same length as `device_mesh.ndim`");
  });
}

TEST(Redistribute, AsyncResultStaysPendingUntilUsed) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto dt = from_local(at::full({2}, static_cast<float>(rank + 1)), mesh, {Partial()});
    auto r = redistribute(dt, {Replicate()}, {.async_op = true});
    EXPECT_TRUE(is_pending(r));
    EXPECT_TENSOR_EQ(local_tensor(r), at::full({2}, 3.0));
    EXPECT_FALSE(is_pending(r));
    auto f = full_tensor(from_local(at::ones({2}), mesh, {Shard(0)}));
    EXPECT_EQ(f.sizes(), at::IntArrayRef({4}));
  });
}

TEST(ImplicitReplication, PlainTensorJoinsAsReplicateOnlyInsideTheGuard) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto dt = from_local(at::ones({4, 3}), mesh, {Shard(0)});
    auto plain = at::ones({3});
    EXPECT_ERROR(at::add(plain, dt), c10::Error, "aten::add.Tensor",
                 "got mixed torch.Tensor and DTensor", "dtensor::ImplicitReplication");
    {
      ImplicitReplication guard;
      auto out = plain + dt;
      EXPECT_EQ(placements(out)[0], Shard(0));
      EXPECT_TENSOR_EQ(local_tensor(out), at::full({4, 3}, 2.0));
    }
    // 0-d and one-element tensors are replicated without the guard.
    auto s = dt * at::scalar_tensor(2.0);
    EXPECT_TENSOR_EQ(local_tensor(s), at::full({4, 3}, 2.0));
  });
}

TEST(SubMesh, RanksOutsideTheMeshGetEmptyLocalTensors) {
  run_ranks(4, [](int rank) {
    comm::init_process_group();
    DeviceMesh mesh(at::kCPU, {2}, {0, 2});
    auto dt = from_local(at::ones({2, 2}), mesh, {Shard(0)});
    auto y = (dt * 2).sum();
    if (rank == 0 || rank == 2) {
      EXPECT_EQ(local_tensor(dt).numel(), 4);
      EXPECT_TENSOR_EQ(full_tensor(y), at::scalar_tensor(16.0));
    } else {
      EXPECT_EQ(local_tensor(dt).numel(), 0);
      EXPECT_EQ(local_tensor(y).dim(), 0);
      EXPECT_EQ(local_tensor(y).item<float>(), 0.0f);
    }
  });
}

TEST(Redistribute, ForwardAndBackwardDtypesCastOnlyWhileCommunicating) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto local = at::full({2, 3}, 1.0 / 3.0, at::kDouble).requires_grad_(true);
    auto x = from_local(local, mesh, {Partial()});
    auto y =
        redistribute(x, {Replicate()}, {.forward_dtype = at::kFloat, .backward_dtype = at::kFloat});
    EXPECT_EQ(y.scalar_type(), at::kDouble);  // cast back after the collective
    // The sum went through float32: 2/3 rounded to float, not the double value.
    EXPECT_DOUBLE_EQ(local_tensor(y)[0][0].item<double>(), static_cast<double>(2.0f / 3.0f));
    auto s = from_local(at::ones({1, 3}, at::kDouble).requires_grad_(true), mesh, {Shard(0)});
    auto r = redistribute(s, {Replicate()}, {.backward_dtype = at::kFloat});
    r.backward(at::full({2, 3}, 0.1, at::kDouble));
    // grad of a Shard input from a Replicate grad is a local chunk; dtype stays double
    EXPECT_EQ(dtensor_impl(r)->spec()->dtype(), at::kDouble);
  });
}
