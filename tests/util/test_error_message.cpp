// util::error_message: LibTorch's errors without their C++ stack trace unless one is asked for.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <stdexcept>
#include <string>

#include "dtensor/comm/error_message.h"
#include "dtensor/util/error_message.h"

using dtensor::util::error_message;

namespace {

// A LibTorch error's texts: what(), what_without_backtrace() and error_message() of it, both
// of the exception and of the captured exception_ptr (which must agree).
struct TorchErrorTexts {
  std::string what, without_backtrace, message;
};
TorchErrorTexts torch_error() {
  try {
    TORCH_CHECK(false, "the one line that matters");
  } catch (const c10::Error& e) {
    const std::string message = error_message(e);
    EXPECT_EQ(error_message(std::current_exception()), message);
    return {e.what(), e.what_without_backtrace(), message};
  }
  ADD_FAILURE() << "TORCH_CHECK(false) did not throw";
  return {};
}

// Sets an environment variable for the scope of one test.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name); }
  const char* name;
};

}  // namespace

TEST(ErrorMessage, DropsLibTorchsStackTrace) {
  const TorchErrorTexts e = torch_error();
  EXPECT_EQ(e.message, e.without_backtrace);
  EXPECT_NE(e.what.find("the one line that matters"), std::string::npos);
  EXPECT_EQ(e.message.find("Exception raised from"), std::string::npos);
}

TEST(ErrorMessage, KeepsTheTraceWhenAskedFor) {
  for (const char* name : {"DTENSOR_SHOW_CPP_STACKTRACES", "TORCH_SHOW_CPP_STACKTRACES"}) {
    ScopedEnv env(name, "1");
    EXPECT_TRUE(dtensor::util::show_cpp_stacktraces()) << name;
    const TorchErrorTexts e = torch_error();
    EXPECT_EQ(e.message, e.what) << name;
  }
  ScopedEnv off("DTENSOR_SHOW_CPP_STACKTRACES", "0");
  EXPECT_FALSE(dtensor::util::show_cpp_stacktraces());
}

TEST(ErrorMessage, NamesOtherExceptionsByWhatAndUnknownOnesAsSuch) {
  EXPECT_EQ(error_message(std::runtime_error("disk full")), "disk full");
  EXPECT_EQ(error_message(std::make_exception_ptr(std::invalid_argument("bad key"))), "bad key");
  EXPECT_EQ(error_message(std::make_exception_ptr(42)), "unknown error");
}

TEST(ErrorMessage, TheDeprecatedCommNamesAreTheSameFunctions) {
  const std::runtime_error e("disk full");
  EXPECT_EQ(dtensor::comm::error_message(e), error_message(e));
  EXPECT_EQ(dtensor::comm::show_cpp_stacktraces(), dtensor::util::show_cpp_stacktraces());
}
