// comm::PendingResult::completed: a result with no collective behind it behaves as a finished one.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/comm/collectives.h"

using dtensor::comm::PendingResult;

TEST(PendingResult, CompletedIsReadyAndAppliesChainedStepsAtOnce) {
  const at::Tensor t = at::arange(6, at::kDouble).reshape({2, 3});
  PendingResult r = PendingResult::completed(t);
  EXPECT_TRUE(r.ready());
  int steps = 0;
  r.then([&](at::Tensor x) {
    ++steps;
    return x * 2;
  });
  EXPECT_EQ(steps, 1);  // no collective to wait for: the step ran already
  const at::Tensor out = r.wait();
  EXPECT_TRUE(at::equal(out, t * 2));
  EXPECT_TRUE(at::equal(r.wait(), out));  // idempotent
  EXPECT_EQ(steps, 1);
}
