// Any torch::nn::Sequential as pipeline stages (dtensor/pp/sequential_stage.h): an MLP split
// over 2 and 4 stages, both schedules, trained 3 AdamW steps, against the whole model on one
// device in float64: loss, every gradient and every parameter (names are the whole model's).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <string>

#include "dtensor/dtensor.h"
#include "dtensor/pp/sequential_stage.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using dtensor::testing::message_of;
using dtensor::testing::run_ranks;

namespace {

torch::nn::Sequential mlp() {
  torch::manual_seed(7);  // the same weights on every rank
  torch::nn::Sequential m(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                          torch::nn::Tanh(), torch::nn::Linear(16, 4));
  m->to(at::kDouble);
  return m;
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).mean();
}

void expect_like_one_device(int64_t pp, bool gpipe, int64_t m) {
  auto mesh = init_device_mesh("cpu", {pp}, {"pp"});
  auto whole = mlp(), reference = mlp();
  auto part = pp::make_sequential_stage(whole, mesh);
  std::unique_ptr<pp::Schedule> schedule;
  if (gpipe) {
    schedule = std::make_unique<pp::ScheduleGPipe>(*part.stage, m, mse);
  } else {
    schedule = std::make_unique<pp::Schedule1F1B>(*part.stage, m, mse);
  }
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW opt(part.module->parameters(), options);
  torch::optim::AdamW ref_opt(reference->parameters(), options);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const at::Tensor x = at::randn({8, 8}, gen, at::kDouble);
    const at::Tensor y = at::randn({8, 4}, gen, at::kDouble);
    opt.zero_grad();
    ref_opt.zero_grad();
    const at::Tensor loss = schedule->step(x, y);
    const at::Tensor ref_loss = mse(reference->forward(x), y);
    ref_loss.backward();
    if (part.stage->is_last()) {
      EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-12 * ref_loss.item<double>());
    } else {
      EXPECT_FALSE(loss.defined());
    }
    auto ref_params = reference->named_parameters();
    for (const auto& item : part.module->named_parameters()) {
      SCOPED_TRACE(item.key());
      ASSERT_TRUE(ref_params.contains(item.key()));
      EXPECT_TENSOR_CLOSE(item.value().grad(), ref_params[item.key()].grad(), 1e-9, 1e-12);
    }
    opt.step();
    ref_opt.step();
  }
  auto ref_params = reference->named_parameters();
  for (const auto& item : part.module->named_parameters()) {
    SCOPED_TRACE(item.key());
    EXPECT_TENSOR_CLOSE(item.value(), ref_params[item.key()], 1e-9, 1e-12);
  }
  // Stage s holds a contiguous range of the 5 modules, under their indices in the whole.
  EXPECT_EQ(static_cast<int64_t>(part.module->size()), part.end - part.first);
  EXPECT_EQ(part.module->named_children()[0].key(), std::to_string(part.first));
}

}  // namespace

TEST(SequentialStage, TwoStagesMatchOneDevice) {
  run_ranks(2, [](int) {
    for (bool gpipe : {true, false}) {
      for (int64_t m : {1, 2, 4}) {
        SCOPED_TRACE(std::string(gpipe ? "gpipe" : "1f1b") + " M=" + std::to_string(m));
        expect_like_one_device(2, gpipe, m);
      }
    }
  });
}

TEST(SequentialStage, FourStagesMatchOneDevice) {
  run_ranks(4, [](int) { expect_like_one_device(4, false, 4); });
}

TEST(SequentialStage, RefusesBadRanges) {
  auto whole = mlp();
  EXPECT_CONTAINS(message_of([&] { pp::split_sequential(whole, 3, 9); }),
                  "is not a non-empty range of the 5 modules");
  auto part = pp::split_sequential(whole, 1, 3);
  ASSERT_EQ(part->size(), 2u);
  // Shared, not copied: the whole model's Linear is the stage's.
  EXPECT_TRUE(part->named_parameters()["2.weight"].is_same(whole->named_parameters()["2.weight"]));
}
