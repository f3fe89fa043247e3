// Softmax family: sweeps over shapes x dims x placements x world sizes against one device,
// forward and backward, plus the placements and collectives PyTorch's tests assert.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/comm_counts.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

struct SoftmaxOp {
  std::string name;
  std::function<at::Tensor(const at::Tensor&, int64_t)> fn;
};

std::vector<SoftmaxOp> softmax_ops() {
  return {
      {"softmax", [](const at::Tensor& x, int64_t d) { return at::softmax(x, d); }},
      {"log_softmax", [](const at::Tensor& x, int64_t d) { return at::log_softmax(x, d); }},
      {"_safe_softmax", [](const at::Tensor& x, int64_t d) { return at::_safe_softmax(x, d); }},
  };
}

OpFn unary(const SoftmaxOp& op, int64_t dim) {
  return [op, dim](const std::vector<at::Tensor>& x) {
    return std::vector<at::Tensor>{op.fn(x[0], dim)};
  };
}

}  // namespace

TEST(SoftmaxSweep, ForwardAndBackwardMatchOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      for (auto shape : std::vector<std::vector<int64_t>>{{4, 6}, {5, 3, 2}, {7}, {1, 5}}) {
        auto a = at::randn(shape, at::kDouble);
        for (const auto& op : softmax_ops()) {
          for (int64_t dim = -1; dim < a.dim(); ++dim) {
            for (const auto& p : placements_1d(a.dim(), true)) {
              const auto label = op.name + " dim " + std::to_string(dim) + " " + to_string(p) +
                                 " " + c10::str(a.sizes());
              n.add(check_op(mesh, label, unary(op, dim), {a}, {p}));
            }
          }
        }
      }
      // 3 ops x (ndim + 1 dims x ndim + 2 layouts) for shapes of ndim 2, 3, 1, 2.
      n.expect_cases(3 * (3 * 4 + 4 * 5 + 2 * 3 + 3 * 4), rank,
                     c10::str("softmax ops, world ", world));
    });
  }
}

// The backward ops called directly, with grad_output and output in every pair of layouts.
TEST(SoftmaxSweep, BackwardDataOpsFollowTheMoreShardedOperand) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      auto x = at::randn({5, 4, 3}, at::kDouble);
      auto g = at::randn({5, 4, 3}, at::kDouble);
      for (int64_t dim : {0, 2}) {
        auto out = at::softmax(x, dim), log_out = at::log_softmax(x, dim);
        for (auto& pl : combinations({placements_1d(3, true), placements_1d(3, false)})) {
          const auto label =
              "dim " + std::to_string(dim) + " " + to_string(pl[0]) + "x" + to_string(pl[1]);
          n.add(check_op(mesh, "_softmax_backward_data " + label,
                         [dim](const std::vector<at::Tensor>& t) {
                           return std::vector<at::Tensor>{
                               at::_softmax_backward_data(t[0], t[1], dim, at::kDouble)};
                         },
                         {g, out}, pl, {.backward = false}));
          n.add(check_op(mesh, "_log_softmax_backward_data " + label,
                         [dim](const std::vector<at::Tensor>& t) {
                           return std::vector<at::Tensor>{
                               at::_log_softmax_backward_data(t[0], t[1], dim, at::kDouble)};
                         },
                         {g, log_out}, pl, {.backward = false}));
        }
      }
      // 2 dims x 5 x 4 layouts x 2 ops.
      n.expect_cases(2 * 5 * 4 * 2, rank, c10::str("softmax backward ops, world ", world));
    });
  }
}

TEST(SoftmaxSweep, TwoDimensionalMeshMatchesOneDevice) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    SweepCounter n;
    auto a = at::randn({4, 5, 3}, at::kDouble);
    const std::vector<Placement> choices{Replicate(), Shard(0), Shard(1), Shard(2), Partial()};
    for (const auto& op : softmax_ops()) {
      for (int64_t dim : {0, 1, 2}) {
        for (const auto& p0 : choices) {
          for (const auto& p1 : choices) {
            Placements p{p0, p1};
            n.add(check_op(mesh, op.name + " dim " + std::to_string(dim) + " " + to_string(p),
                           unary(op, dim), {a}, {p}));
          }
        }
      }
    }
    // 3 ops x 3 dims x 5 x 5 layouts.
    n.expect_cases(3 * 3 * 5 * 5, rank, "softmax ops, 2x2 mesh");
  });
}

// PyTorch's test_softmax_fwd/bwd: a shard off the softmax dim stays, with no communication
// forward or backward; a shard on it is gathered (one all_gather), and the output and the
// input's gradient are replicated.
TEST(Softmax, ShardsOffTheSoftmaxDimStayWithoutCommunication) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto x = at::randn({8, 12, 16}, at::kDouble);
    for (int64_t shard : {0, 1, 2}) {
      for (int64_t dim : {0, 1, 2}) {
        SCOPED_TRACE("shard " + std::to_string(shard) + " softmax dim " + std::to_string(dim));
        auto dx = distribute_tensor(x, mesh, {Shard(shard)}).requires_grad_(true);
        CommDebugMode comm;
        auto y = at::log_softmax(dx, dim);
        if (shard == dim) {
          EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::all_gather_into_tensor, 1}}));
          EXPECT_EQ(placements(y)[0], Replicate());
        } else {
          EXPECT_EQ(comm.get_total_counts(), 0);
          EXPECT_EQ(placements(y)[0], Shard(shard));
        }
        auto loss = y.sum();
        comm.enter();
        loss.backward();
        EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
        EXPECT_EQ(placements(dx.grad())[0], shard == dim ? Replicate() : Shard(shard));
        auto ref = x.clone().requires_grad_(true);
        at::log_softmax(ref, dim).sum().backward();
        EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), ref.grad(), 1e-10, 1e-10);
      }
    }
  });
}
