#pragma once
// Checking error messages: the text of the c10::Error a call throws, and a substring check.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace dtensor::testing {

// The message (without backtrace) of the c10::Error `f` throws, or "(no error)".
inline std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

}  // namespace dtensor::testing

#define EXPECT_CONTAINS(text, part)                          \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "expected \"" << (part) << "\" in: " << (text)
