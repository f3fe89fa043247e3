// ColwiseParallel then RowwiseParallel over a hidden size the ranks do not divide (6 features
// on 4 ranks split 2, 2, 2, 0): the plain local tensor between the two layers is rebuilt into
// the same global tensor on every rank, so forward and backward equal one device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/mpi_job.h"

using namespace dtensor;
using namespace dtensor::tp;
using dtensor::testing::run_ranks;
using dtensor::testing::world_sizes_to_run;

namespace {

struct TwoLayerImpl : dtensor::nn::Module {
  dtensor::nn::Linear up{nullptr}, down{nullptr};
  TwoLayerImpl(int64_t dim, int64_t hidden) {
    up = register_module("up", dtensor::nn::Linear(dim, hidden));
    down = register_module("down", dtensor::nn::Linear(hidden, dim));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& x) { return down(up(x).tanh()); }, x);
  }
};
TORCH_MODULE(TwoLayer);

}  // namespace

TEST(UnevenFeatures, ColwiseThenRowwiseOverAnUnevenHiddenSizeMatchesOneDevice) {
  const auto sizes = world_sizes_to_run({3, 4});
  if (sizes.empty()) GTEST_SKIP() << "runs with 3 or 4 ranks";
  for (int world : sizes) {
    run_ranks(world, [world](int) {
      auto mesh = init_device_mesh("cpu", {world}, {"tp"});
      at::manual_seed(0);
      TwoLayer ref(4, 6);
      at::manual_seed(0);
      TwoLayer model(4, 6);
      parallelize_module(*model, mesh, {{"up", ColwiseParallel()}, {"down", RowwiseParallel()}});
      const auto x = at::randn({3, 4}, at::kDouble);
      auto yr = ref(x);
      auto yd = model(x);
      ASSERT_FALSE(is_dtensor(yd));  // RowwiseParallel's default: a plain replicated output
      EXPECT_TENSOR_CLOSE(yd, yr, 1e-12, 1e-12);
      (yr * yr).sum().backward();
      (yd * yd).sum().backward();
      for (const auto& p : ref->named_parameters()) {
        SCOPED_TRACE(p.key());
        const at::Tensor& g = model->named_parameters()[p.key()].grad();
        ASSERT_TRUE(g.defined());
        EXPECT_TENSOR_CLOSE(is_dtensor(g) ? full_tensor(g) : g, p.value().grad(), 1e-12, 1e-12);
      }
    });
  }
}
