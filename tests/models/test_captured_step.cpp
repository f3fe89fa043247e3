// CapturedStep refuses, with the reason, a step a CUDA graph cannot hold (pipeline point to
// point, dropless expert dispatch, a changing shape, CPU tensors) and, in a build against a CPU
// LibTorch, every capture. Its capture and replay are checked on a GPU (tests/cuda, and
// bench_captured_step: 20 steps' losses bitwise equal eager and captured).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/models/captured_step.h"
#include "support/errors.h"

using namespace dtensor::models;
using dtensor::testing::message_of;

namespace {

TEST(CapturedStep, RefusesWhatAGraphCannotHoldNamingTheReason) {
  CaptureConditions c;
  c.cuda = true;
  c.pipeline = true;
  EXPECT_NE(capture_refusal(c).value_or("").find("point to point"), std::string::npos);
  c.pipeline = false;
  c.dropless_experts = true;
  EXPECT_NE(capture_refusal(c).value_or("").find("dropless expert dispatch"), std::string::npos);
  c.dropless_experts = false;
  c.dynamic_seq_len = true;
  EXPECT_NE(capture_refusal(c).value_or("").find("change shape"), std::string::npos);
  c.dynamic_seq_len = false;
  c.cuda = false;
  EXPECT_NE(capture_refusal(c).value_or("").find("runs on the CPU"), std::string::npos);
}

TEST(CapturedStep, ABuildAgainstACpuLibTorchRefusesEveryCapture) {
  CaptureConditions c;
  c.cuda = true;
  if (built_with_cuda_graphs()) {
    EXPECT_EQ(capture_refusal(c), std::nullopt);
  } else {
    EXPECT_NE(capture_refusal(c).value_or("").find("CPU LibTorch"), std::string::npos);
  }
}

TEST(CapturedStep, AStepOnCpuTensorsIsRefusedAtConstruction) {
  const at::Tensor tokens = at::zeros({2, 4}, at::kLong);
  const std::string message =
      message_of([&] { CapturedStep step([&] { return tokens.sum(); }, {tokens}); });
  EXPECT_NE(message.find("CapturedStep: the step runs on the CPU"), std::string::npos) << message;
}

}  // namespace
