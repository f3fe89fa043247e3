// clip_grad_norm_ over gradients with mixed placements equals one device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>

#include <limits>

#include "dtensor/dtensor.h"
#include "support/distributed.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

TEST(ClipGradNorm, MixedPlacementsClipLikeOneDevice) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    for (double p : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
      SCOPED_TRACE("p=" + std::to_string(p));
      auto g1 = at::randn({10, 3}, at::kDouble), g2 = at::randn({7}, at::kDouble),
           g3 = at::randn({4, 4}, at::kDouble);
      // single device
      std::vector<at::Tensor> ref;
      for (auto& g : {g1, g2, g3}) {
        auto t = at::zeros_like(g).requires_grad_(true);
        t.mutable_grad() = g.clone();
        ref.push_back(t);
      }
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref, 0.5, p);
      // distributed: a sharded, a replicated and a pending-sum gradient (as sequence-parallel
      // norm weights have)
      auto make = [&](const at::Tensor& g, const Placements& pl) {
        auto t = distribute_tensor(at::zeros_like(g), mesh, clear_partial(pl)).requires_grad_(true);
        if (pl[0].is_partial()) {
          t.mutable_grad() = from_local(g / 4, mesh, pl);
        } else {
          t.mutable_grad() = distribute_tensor(g, mesh, pl);
        }
        return t;
      };
      std::vector<at::Tensor> dist{make(g1, {Shard(0)}), make(g2, {Replicate()}),
                                   make(g3, {Partial()})};
      CommDebugMode comm;
      const double norm = torch::nn::utils::clip_grad_norm_(dist, 0.5, p);
      EXPECT_NEAR(norm, ref_norm, 1e-10);
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_TENSOR_CLOSE(full_tensor(dist[i].grad()), ref[i].grad(), 1e-10, 1e-10);
      }
    }
  });
}
