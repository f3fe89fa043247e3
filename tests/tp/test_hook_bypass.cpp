// A module with forward hooks (a parallel style's) whose forward does not go through
// call_forward would skip them and compute on unconverted inputs; the call is refused instead,
// naming the module, as soon as a hook-capable submodule of it runs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::testing;
using namespace dtensor::tp;

namespace {

// Forgets call_forward: hooks registered on it never run.
struct BypassImpl : dtensor::nn::Module {
  BypassImpl() { fc = register_module("fc", dtensor::nn::Linear(8, 8)); }
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  dtensor::nn::Linear fc{nullptr};
};
TORCH_MODULE(Bypass);

// Routes its forward through call_forward.
struct RoutedImpl : dtensor::nn::Module {
  RoutedImpl() { fc = register_module("fc", dtensor::nn::Linear(8, 8)); }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& t) { return fc(t); }, x);
  }
  dtensor::nn::Linear fc{nullptr};
};
TORCH_MODULE(Routed);

template <class Inner>
struct OuterImpl : dtensor::nn::Module {
  OuterImpl() { inner = register_module("inner", Inner()); }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& t) { return inner->forward(t); }, x);
  }
  Inner inner{nullptr};
};

// Gathers the batch rows each rank holds: [4, 8] local -> [8, 8].
Style gather_rows() {
  return PrepareModuleInput({.input_layouts = Layouts{Shard(0)},
                             .desired_input_layouts = Layouts{Replicate()},
                             .use_local_output = true});
}

}  // namespace

TEST(HookBypass, NestedModuleWithoutCallForwardIsRefusedByName) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto routed = std::make_shared<OuterImpl<Routed>>();
    parallelize_module(*routed, mesh, ParallelizePlan{{"inner", gather_rows()}});
    EXPECT_EQ(routed->forward(at::randn({4, 8})).sizes(), (std::vector<int64_t>{8, 8}));

    auto bypass = std::make_shared<OuterImpl<Bypass>>();
    parallelize_module(*bypass, mesh, ParallelizePlan{{"inner", gather_rows()}});
    EXPECT_ERROR(bypass->forward(at::randn({4, 8})), c10::Error, "module 'inner' (", "Bypass)",
                 "its forward hooks did not run", "call_forward");
  });
}

TEST(HookBypass, RootWithoutCallForwardIsRefusedAndDirectCallsNeedAGuard) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    Bypass root;
    parallelize_module(*root, mesh,
                       PrepareModuleOutput({.output_layouts = Layouts{Shard(0)},
                                            .desired_output_layouts = Layouts{Replicate()}}));
    EXPECT_ERROR(root->forward(at::randn({4, 8})), c10::Error, "the root module (", "Bypass)",
                 "'fc'", "DirectCallGuard");

    // Calling the submodule on its own on purpose (the parent's hooks are not meant to run).
    Routed model;
    parallelize_module(*model, mesh, gather_rows());
    EXPECT_EQ(model->forward(at::randn({4, 8})).sizes(), (std::vector<int64_t>{8, 8}));
    EXPECT_ERROR(model->fc(at::randn({4, 8})), c10::Error, "Routed)");
    DirectCallGuard direct;
    EXPECT_EQ(model->fc(at::randn({4, 8})).sizes(), (std::vector<int64_t>{4, 8}));
  });
}
