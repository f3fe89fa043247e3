// Forward hooks on C++ modules: the hook-capable layers and dtensor::nn::Module.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>

#include "dtensor/nn/layers.h"

namespace {

using dtensor::tp::Kwargs;
using dtensor::tp::ModuleCall;

TEST(ModuleHooks, LinearWithoutHooksEqualsTorchLinear) {
  dtensor::nn::Linear fc(4, 3);
  auto x = at::randn({2, 4});
  EXPECT_TRUE(at::equal(fc(x), at::linear(x, fc->weight, fc->bias)));
  EXPECT_NE(dynamic_cast<torch::nn::LinearImpl*>(fc.ptr().get()), nullptr);
}

TEST(ModuleHooks, PreHookRewritesInputAndHookRewritesOutput) {
  dtensor::nn::Linear fc(4, 3);
  auto x = at::randn({2, 4});
  auto pre = fc->register_forward_pre_hook(
      [](torch::nn::Module&, ModuleCall& call) { call.args[0] = call.args[0].toTensor() * 2; });
  auto post = fc->register_forward_hook(
      [](torch::nn::Module&, const ModuleCall&, c10::IValue& out) { out = out.toTensor() + 1; });
  EXPECT_TRUE(at::allclose(fc(x), at::linear(x * 2, fc->weight, fc->bias) + 1));
  fc->remove_hook(pre);
  EXPECT_TRUE(at::allclose(fc(x), at::linear(x, fc->weight, fc->bias) + 1));
  fc->remove_hook(post);
  EXPECT_EQ(fc->num_hooks(), 0u);
  EXPECT_TRUE(at::allclose(fc(x), at::linear(x, fc->weight, fc->bias)));
}

// Python's nn.Linear calls at::linear, which adds the bias of a 3-D input inside one addmm;
// LibTorch's C++ F::linear adds it in a second op, rounding twice in bfloat16.
TEST(ModuleHooks, LinearOfA3DBfloat16InputEqualsPythonsLinear) {
  at::manual_seed(0);
  dtensor::nn::Linear fc(72, 72);
  fc->to(at::kBFloat16);
  const auto x = at::randn({2, 12, 72}).to(at::kBFloat16);
  const at::Tensor python = at::linear(x, fc->weight, fc->bias);
  EXPECT_TRUE(at::equal(fc(x), python));
  // The two roundings differ here, so the check above can tell them apart.
  EXPECT_FALSE(at::equal(at::matmul(x, fc->weight.t()) + fc->bias, python));
}

struct TwoInTwoOutImpl : dtensor::nn::Module {
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& a, int64_t k) {
    return call_forward(
        [](const at::Tensor& a, int64_t k) { return std::make_tuple(a * k, a + k); }, a, k);
  }
  at::Tensor forward_kw(const at::Tensor& x, Kwargs kwargs) {
    ModuleCall call{{x}, std::move(kwargs)};
    return call_forward_kw(
               [](const ModuleCall& c) {
                 const auto* y = c.kwarg("y");
                 return c10::IValue(c.args[0].toTensor() + (y ? y->toTensor() : at::zeros({})));
               },
               std::move(call))
        .toTensor();
  }
};
TORCH_MODULE(TwoInTwoOut);

TEST(ModuleHooks, UserModuleSeesPositionalScalarsTuplesAndKwargs) {
  TwoInTwoOut m;
  m->register_forward_pre_hook([](torch::nn::Module&, ModuleCall& call) {
    if (call.args.size() == 2) call.args[1] = c10::IValue(call.args[1].toInt() + 1);
    if (auto* y = call.kwarg("y")) *y = y->toTensor() * 10;
  });
  auto [p, q] = m->forward(at::ones({2}), 2);
  EXPECT_TRUE(at::equal(p, at::full({2}, 3.0)));
  EXPECT_TRUE(at::equal(q, at::full({2}, 4.0)));
  auto r = m->forward_kw(at::ones({2}), {{"y", at::ones({2})}});
  EXPECT_TRUE(at::equal(r, at::full({2}, 11.0)));
}

TEST(ModuleHooks, RMSNormMatchesFormulaAndNameModulesSetsPaths) {
  torch::nn::Sequential seq(dtensor::nn::RMSNorm(8), dtensor::nn::Dropout(0.0));
  auto x = at::randn({3, 8}, at::kDouble);
  seq->to(at::kDouble);
  auto ref = x * at::rsqrt(x.pow(2).mean(-1, true) + std::numeric_limits<double>::epsilon());
  EXPECT_TRUE(at::allclose(seq->forward(x), ref));
  dtensor::tp::name_modules(*seq);
  EXPECT_EQ(std::dynamic_pointer_cast<dtensor::tp::HookedModule>(seq[1])->fqn(), "1");
}

// In bfloat16 the plain norm rounds the normalised value before scaling it (HF's LlamaRMSNorm:
// weight * x.float().normalised().to(bfloat16)); LibTorch's fused at::rms_norm with a weight scales
// first, a different bit in about a quarter of the elements.
TEST(ModuleHooks, RMSNormInBfloat16RoundsBeforeScalingAsHF) {
  at::manual_seed(0);
  dtensor::nn::RMSNormOptions options(48);
  options.eps = 1e-5;
  dtensor::nn::RMSNorm norm(options);
  {
    at::NoGradGuard no_grad;
    norm->weight.uniform_(0.5, 1.5);
  }
  norm->to(at::kBFloat16);
  const auto x = (at::randn({4, 12, 48}) * 3).to(at::kBFloat16);
  const auto f = x.to(at::kFloat);
  const auto hf = norm->weight * (f * at::rsqrt(f.pow(2).mean(-1, true) + 1e-5)).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(norm(x), hf));
  EXPECT_FALSE(at::equal(at::rms_norm(x, {48}, norm->weight, 1e-5), hf));
}

}  // namespace
