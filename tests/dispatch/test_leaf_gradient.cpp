// A DTensor leaf's gradient is a DTensor laid out as the leaf, also where the derivative
// formula builds it as a plain tensor (zeros_like, _efficientzerotensor, at::zeros).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

namespace {

// One op whose derivative formula gives input `scratch` (0: x, 1: y) a gradient made from
// scratch; the other input's gradient comes from the op's own DTensor math.
struct Case {
  const char* what;
  int scratch;
  std::function<at::Tensor(const at::Tensor& x, const at::Tensor& y)> op;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      // other: zeros_like(other), which autograd's codegen turns into at::zeros(sizes, options)
      {"copysign", 1, [](const at::Tensor& x, const at::Tensor& y) { return at::copysign(x, y); }},
      {"nextafter", 1,
       [](const at::Tensor& x, const at::Tensor& y) { return at::nextafter(x, y); }},
      // sgn of a real tensor: at::_efficientzerotensor
      {"sgn", 0, [](const at::Tensor& x, const at::Tensor& y) { return at::sgn(x) * y; }},
      // a repeat count of 0: at::zeros(input sizes, grad.options())
      {"repeat", 0,
       [](const at::Tensor& x, const at::Tensor& y) {
         return x.repeat({0, 1}).sum() + y;
       }},
  };
  return c;
}

// The gradient of a DTensor leaf: a DTensor on the leaf's mesh whose value is the one-device
// gradient; one made from scratch is laid out as the leaf (no collective made it).
void expect_gradient(const at::Tensor& got, const at::Tensor& leaf, const at::Tensor& want,
                     bool scratch, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_TRUE(is_dtensor(got)) << what << ": a plain gradient";
  EXPECT_TRUE(device_mesh(got) == device_mesh(leaf)) << what;
  if (scratch) {
    EXPECT_EQ(placements(got), placements(leaf)) << what;
  }
  EXPECT_TENSOR_EQ(full_tensor(got), want) << what;
}

}  // namespace

TEST(LeafGradient, GradientsFormulasBuildFromScratchAreDTensorsOfTheLeafsLayout) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::manual_seed(0);
    const at::Tensor a = at::randn({6, 4}), b = at::randn({6, 4});
    for (const Case& c : cases()) {
      at::Tensor px = a.clone().requires_grad_(), py = b.clone().requires_grad_();
      c.op(px, py).sum().backward();
      // backward(): the gradients accumulate in the leaves
      at::Tensor x = distribute_tensor(a, mesh, {Shard(0)}).requires_grad_();
      at::Tensor y = distribute_tensor(b, mesh, {Shard(1)}).requires_grad_();
      c.op(x, y).sum().backward();
      expect_gradient(x.grad(), x, px.grad(), c.scratch == 0,
                      std::string(c.what) + " backward() x");
      expect_gradient(y.grad(), y, py.grad(), c.scratch == 1,
                      std::string(c.what) + " backward() y");
      // torch::autograd::grad: the gradients are captured, not accumulated
      const auto g = torch::autograd::grad({c.op(x, y).sum()}, {x, y});
      expect_gradient(g[0], x, px.grad(), c.scratch == 0, std::string(c.what) + " grad() x");
      expect_gradient(g[1], y, py.grad(), c.scratch == 1, std::string(c.what) + " grad() y");
    }
  });
}

TEST(LeafGradient, ZeroGradientsAccumulateOverBackwardPassesAndUserHooksSeeDTensors) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor x = distribute_tensor(at::randn({4, 3}), mesh, {Shard(0)}).requires_grad_();
    int hooked = 0;
    x.register_hook([&hooked](const at::Tensor& g) {
      EXPECT_TRUE(is_dtensor(g)) << "the user's hook got a plain gradient";
      ++hooked;
    });
    // sgn's gradient is a ZeroTensor, which cannot be written: the second backward adds to
    // the first one's gradient in place.
    for (int i = 0; i < 2; ++i) at::sgn(x).sum().backward();
    EXPECT_EQ(hooked, 2);
    expect_gradient(x.grad(), x, at::zeros({4, 3}), true, "sgn twice");
    // and a gradient that is not zero adds to it
    (x * 2).sum().backward();
    expect_gradient(x.grad(), x, at::full({4, 3}, 2.0), false, "sgn twice, then x * 2");
  });
}
