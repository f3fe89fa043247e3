// EXPECT_ERROR / ASSERT_ERROR (support/errors.h) fail when nothing is thrown, when another
// exception type is thrown, or when the message lacks a part; otherwise they pass.
#include <c10/util/Exception.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "support/errors.h"

namespace {
void fail_with(const char* msg) { TORCH_CHECK(false, msg); }
void fail_with_value_error(const char* msg) { TORCH_CHECK_VALUE(false, msg); }
void succeed() {}
}  // namespace

TEST(ErrorChecks, PassWhenTheTypeAndEveryPartMatch) {
  EXPECT_ERROR(fail_with("alpha then beta"), c10::Error, "alpha", "beta");
  // A subclass of the expected type counts.
  EXPECT_ERROR(fail_with_value_error("bad value"), c10::Error, "bad value");
  EXPECT_ERROR(fail_with_value_error("bad value"), c10::ValueError, "bad value");
  EXPECT_ERROR(throw std::runtime_error("boom"), std::runtime_error, "boom");
  const std::vector<std::string> parts{"alpha", "then"};
  ASSERT_ERROR(fail_with("alpha then beta"), c10::Error, parts);
}

TEST(ErrorChecks, FailWhenNothingIsThrown) {
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR(succeed(), c10::Error, "alpha"),
                          "succeed() throws c10::Error.\n  Actual: it throws nothing.");
  EXPECT_FATAL_FAILURE(ASSERT_ERROR(succeed(), c10::Error, "alpha"), "it throws nothing");
}

TEST(ErrorChecks, FailWhenAnotherTypeIsThrownAndShowItsMessage) {
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR(fail_with("plain"), c10::ValueError, "plain"),
                          "Actual: it throws c10::Error: plain");
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR(throw std::runtime_error("boom"), c10::Error, "boom"),
                          "Actual: it throws std::runtime_error: boom");
}

TEST(ErrorChecks, FailWhenAPartIsMissingAndShowTheMessage) {
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR(fail_with("alpha then beta"), c10::Error, "alpha", "gamma"),
                          "its message lacks:\n    \"gamma\"\n  The message: alpha then beta");
}
