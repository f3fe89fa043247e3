// What the kernel guarantees about global metadata: ops refuse global shapes that the op
// itself would refuse (on every rank, naming op, placements and shapes); a DTensor's strides
// describe its layout as a plain tensor's would, so views, reshapes and matrix ops after a
// transpose work on every rank, empty shards included; errors name the op that raised them;
// ExplicitRedistribution refuses implicit communication.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

TEST(GlobalChecks, AddRefusesShapesThatDoNotBroadcast) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto a = distribute_tensor(at::randn({8, 4}), mesh, {Shard(0)});
    auto b = distribute_tensor(at::randn({4, 4}), mesh, {Shard(0)});
    EXPECT_ERROR(at::add(a, b), c10::Error, "aten::add.Tensor", "[8, 4]", "[4, 4]", "S(0)");
  });
}

TEST(GlobalChecks, AddRefusesMismatchedShardedDims) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto a = distribute_tensor(at::randn({5, 12}), mesh, {Shard(1)});
    auto b = distribute_tensor(at::randn({5, 10}), mesh, {Shard(1)});
    EXPECT_ERROR(at::add(a, b), c10::Error, "aten::add.Tensor", "[5, 12]", "[5, 10]");
    // In place too: the written tensor's shape is checked against the broadcast.
    EXPECT_ERROR(a.add_(b), c10::Error, "aten::add_.Tensor");
  });
}

TEST(GlobalChecks, MatrixProductsRefuseMismatchedContractedDims) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto a = distribute_tensor(at::randn({5, 12}), mesh, {Shard(1)});
    auto b = distribute_tensor(at::randn({10, 6}), mesh, {Shard(0)});
    EXPECT_ERROR(at::mm(a, b), c10::Error, "aten::mm", "[5, 12]", "[10, 6]");
    // dot and mv have no meta kernels: their rule checks the sizes itself.
    auto u = distribute_tensor(at::randn({12}), mesh, {Shard(0)});
    auto v = distribute_tensor(at::randn({10}), mesh, {Shard(0)});
    EXPECT_ERROR(at::dot(u, v), c10::Error, "aten::dot");
    auto m = distribute_tensor(at::randn({4, 12}), mesh, {Replicate()});
    EXPECT_ERROR(at::mv(m, v), c10::Error, "aten::mv");
  });
}

// Every rank refuses, including one whose shard is empty (3 ranks over 2 rows).
TEST(GlobalChecks, EveryRankRefusesEvenWithAnEmptyShard) {
  run_ranks(3, [](int) {
    auto mesh = init_device_mesh("cpu", {3});
    auto a = distribute_tensor(at::randn({2, 4}), mesh, {Shard(0)});
    auto b = distribute_tensor(at::randn({2, 3}), mesh, {Shard(0)});
    EXPECT_ERROR(at::mul(a, b), c10::Error, "aten::mul.Tensor");
  });
}

namespace {

// The sizes and strides of `dt` equal those of the same computation on one device.
void expect_layout(const at::Tensor& dt, const at::Tensor& ref, const std::string& what) {
  EXPECT_EQ(dt.sizes(), ref.sizes()) << what;
  EXPECT_EQ(dt.strides(), ref.strides()) << what;
  EXPECT_TRUE(dtensor::testing::tensors_close(full_tensor(dt), ref, 1e-12, 1e-12)) << what;
}

}  // namespace

// After a transpose and an element-wise op, the result is laid out like the transposed input,
// on one device and as a DTensor; flatten, reshape, matmul, linear and backward then work on
// every rank (3 ranks over dims of 2 give one empty shard).
TEST(GlobalChecks, StridesFollowTheLayoutAfterTransposeAndPointwise) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](int) {
      auto mesh = init_device_mesh("cpu", {world});
      for (const Placements& pl : {Placements{Shard(0)}, Placements{Shard(1)}, Placements{Shard(2)},
                                   Placements{Replicate()}}) {
        SCOPED_TRACE(to_string(pl));
        at::manual_seed(1);
        const auto x0 = at::randn({2, 5, 3}, at::kDouble);
        const auto w0 = at::randn({4, 2}, at::kDouble);
        auto xr = x0.clone().requires_grad_(true);
        auto xd = distribute_tensor(x0, mesh, pl).requires_grad_(true);
        auto yr = xr.transpose(0, 2) * 2 + 1;  // [3, 5, 2], permuted
        auto yd = xd.transpose(0, 2) * 2 + 1;
        expect_layout(yd, yr, "pointwise after transpose");
        expect_layout(yd.exp(), yr.exp(), "unary after transpose");
        expect_layout(yd.flatten(), yr.flatten(), "flatten");
        expect_layout(yd.reshape({15, 2}), yr.reshape({15, 2}), "reshape");
        expect_layout(yd.contiguous(), yr.contiguous(), "contiguous");
        auto wd = distribute_tensor(w0, mesh, {Replicate()});
        auto zr = at::matmul(yr, w0.t());
        auto zd = at::matmul(yd, wd.t());
        expect_layout(zd, zr, "matmul");
        auto lr = at::linear(yr, w0);
        auto ld = at::linear(yd, wd);
        expect_layout(ld, lr, "linear");
        (lr * lr).sum().backward();
        (ld * ld).sum().backward();
        expect_layout(xd.grad(), xr.grad(), "gradient");
      }
    });
  }
}

TEST(GlobalChecks, ErrorsDuringTheLocalCallNameTheOp) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    // The index is out of range only on the global tensor's terms; the local gather raises.
    auto x = distribute_tensor(at::randn({4, 6}), mesh, {Replicate()});
    auto idx = distribute_tensor(at::full({4, 2}, 9, at::kLong), mesh, {Replicate()});
    EXPECT_ERROR(at::gather(x, 1, idx), c10::Error, "aten::gather");
  });
}

TEST(GlobalChecks, ExplicitRedistributionRefusesImplicitCommunication) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto a = distribute_tensor(at::randn({4, 6}), mesh, {Shard(0)});
    auto w = distribute_tensor(at::randn({6, 6}), mesh, {Shard(1)});
    auto r = distribute_tensor(at::randn({4, 6}), mesh, {Replicate()});
    {
      ExplicitRedistribution strict;
      // Moves out of Replicate communicate nothing: allowed.
      auto s = a + r;
      EXPECT_EQ(placements(s)[0], Shard(0));
      // Shard(0) x Shard(1) needs an all-gather of one operand.
      EXPECT_ERROR(at::mm(a, w), c10::Error, "aten::mm", "ExplicitRedistribution", "(forward)");
      // Asked for explicitly: fine.
      auto full = at::mm(redistribute(a, mesh, {Replicate()}), w);
      EXPECT_EQ(placements(full)[0], Shard(1));
    }
    EXPECT_FALSE(ExplicitRedistribution::enabled());
    at::mm(a, w);  // outside the guard the implicit all-gather is fine again
  });
}

TEST(GlobalChecks, ExplicitRedistributionCoversBackward) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::manual_seed(0);
    const auto a0 = at::randn({4, 6}, at::kDouble), w0 = at::randn({6, 6}, at::kDouble),
               c0 = at::randn({4, 6}, at::kDouble);
    // A product scaled by a tensor sharded on another dim: its gradients need operands moved
    // between layouts again in backward. Forward runs outside the guard.
    auto loss_of = [&] {
      auto a = distribute_tensor(a0, mesh, {Shard(0)}).requires_grad_(true);
      auto w = distribute_tensor(w0, mesh, {Shard(1)}).requires_grad_(true);
      auto c = distribute_tensor(c0, mesh, {Shard(1)});
      return (at::mm(a, w) * c).sum();
    };
    CommDebugMode comm;
    auto loss = loss_of();
    comm.enter();
    loss.backward();
    ASSERT_GT(comm.get_total_counts(), 0) << "this backward should communicate";
    comm.exit();
    auto strict_loss = loss_of();
    ExplicitRedistribution strict;
    EXPECT_ERROR(strict_loss.backward(), c10::Error, "ExplicitRedistribution", "(backward)");
  });
}
