// Linear algebra rules (src/ops/linalg_ops.cpp) against one device, forward and backward.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

// Well-conditioned triangular matrices: a unit-ish diagonal keeps the solve's values moderate.
at::Tensor triangular(std::vector<int64_t> shape, bool upper) {
  at::Tensor a = at::randn(shape, at::kDouble) * 0.3;
  a = upper ? a.triu() : a.tril();
  return a + at::eye(shape.back(), at::kDouble) * 2;
}

}  // namespace

// linalg_solve_triangular: batch dims sharded (A's with B's, or A replicated where it
// broadcasts), a pending sum of B passing to the result, matrix dims gathered; its backward
// (two more triangular solves and a matmul) on the same layouts.
TEST(LinalgOps, SolveTriangularMatchesOneDeviceOnEveryLayout) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    SweepCounter n;
    struct Shapes {
      std::vector<int64_t> a, b;
      bool left;
    };
    const std::vector<Shapes> shapes = {
        {{3, 4, 4}, {3, 4, 2}, true},         // batch of 3 on both
        {{4, 4}, {3, 4, 5}, true},            // A broadcast over B's batch
        {{2, 1, 3, 3}, {2, 5, 4, 3}, false},  // a size-1 batch dim of A, X A = B
    };
    for (const auto& s : shapes) {
      for (bool upper : {true, false}) {
        const at::Tensor a = triangular(s.a, upper), b = at::randn(s.b, at::kDouble);
        const auto pa = placements_1d(static_cast<int64_t>(s.a.size()));
        const auto pb = placements_1d(static_cast<int64_t>(s.b.size()), /*with_partial=*/true);
        for (const auto& pl : combinations({pa, pb})) {
          const std::string label =
              c10::str("solve_triangular A", c10::IntArrayRef(s.a), " ", to_string(pl[0]), " B",
                       c10::IntArrayRef(s.b), " ", to_string(pl[1]), upper ? " upper" : " lower",
                       s.left ? " left" : " right");
          n.add(check_op(
              mesh, label,
              [upper, left = s.left](const std::vector<at::Tensor>& x) {
                return std::vector<at::Tensor>{
                    at::linalg_solve_triangular(x[0], x[1], upper, left, false)};
              },
              // LibTorch's CPU kernel returns column-major matrices, its meta kernel row-major
              // ones; a DTensor reports the meta strides, as PyTorch's DTensor does.
              {a, b}, pl, {.rtol = 1e-9, .atol = 1e-9, .layout = false}));
        }
      }
    }
    // upper and lower x the layout pairs: R and each shard of A, and of B, P too for B.
    n.expect_cases(2 * (4 * 5 + 3 * 5 + 5 * 6), rank, "linalg_solve_triangular");
  });
}

// The placements it picks, with exact collective counts: batch shards stay where they are, A
// following B (or replicated where it broadcasts), a pending sum of B passes, a sharded
// matrix dim is gathered.
TEST(LinalgOps, SolveTriangularKeepsBatchShardsAndAPendingSumOfB) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor a = triangular({4, 3, 3}, true), b = at::randn({4, 3, 2}, at::kDouble);
    auto solve = [](const at::Tensor& x, const at::Tensor& y) {
      return at::linalg_solve_triangular(x, y, /*upper=*/true);
    };
    const at::Tensor want = solve(a, b);
    struct Case {
      Placements a, b, out;
      CommCounts comm;
    };
    const std::vector<Case> cases = {
        {{Replicate()}, {Shard(0)}, {Shard(0)}, {}},
        {{Shard(0)}, {Shard(0)}, {Shard(0)}, {}},
        {{Shard(0)}, {Replicate()}, {Shard(0)}, {}},
        {{Replicate()}, {Partial()}, {Partial()}, {}},
        {{Replicate()}, {Shard(1)}, {Replicate()}, {{CommType::all_gather_into_tensor, 1}}},
    };
    for (const auto& c : cases) {
      const at::Tensor da = distribute_tensor(a, mesh, c.a);
      const at::Tensor db =
          c.b[0].is_partial() ? from_local(b / 2, mesh, c.b) : distribute_tensor(b, mesh, c.b);
      CommDebugMode comm;
      const at::Tensor out = solve(da, db);
      comm.exit();
      const std::string what = to_string(c.a) + " " + to_string(c.b);
      EXPECT_EQ(placements(out), c.out) << what;
      EXPECT_EQ(comm.get_comm_counts(), c.comm) << what;
      EXPECT_TENSOR_CLOSE(full_tensor(out), want, 1e-10, 1e-10);
    }
  });
}
