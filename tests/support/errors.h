#pragma once
// Checking errors: EXPECT_ERROR / ASSERT_ERROR for a statement that must throw a given exception
// type whose message contains given parts, plus the text of a c10::Error and a substring check.
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>
#include <typeinfo>
#include <vector>

namespace dtensor::testing {

// The message of what `f` throws (a c10::Error without its backtrace, any other exception's
// what()), or "(no error)".
inline std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

namespace detail {

inline std::string text_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e))
    return c10_error->what_without_backtrace();
  return e.what();
}

// Success when `f` throws an `E` (or a subclass) whose message contains every one of `parts`;
// otherwise a failure that says what was thrown instead, with its message.
template <typename E>
::testing::AssertionResult throws_error(const char* statement, const char* type,
                                        const std::function<void()>& f,
                                        const std::vector<std::string>& parts) {
  std::string msg;
  try {
    f();
    return ::testing::AssertionFailure()
           << "Expected: " << statement << " throws " << type << ".\n  Actual: it throws nothing.";
  } catch (const std::exception& e) {
    if (dynamic_cast<const E*>(&e) == nullptr) {
      return ::testing::AssertionFailure()
             << "Expected: " << statement << " throws " << type << ".\n  Actual: it throws "
             << c10::demangle(typeid(e).name()) << ": " << text_of(e);
    }
    msg = text_of(e);
  } catch (...) {
    return ::testing::AssertionFailure() << "Expected: " << statement << " throws " << type
                                         << ".\n  Actual: it throws a non-std::exception.";
  }
  std::string missing;
  for (const auto& part : parts) {
    if (msg.find(part) == std::string::npos) missing += "\n    \"" + part + "\"";
  }
  if (missing.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << statement << " throws " << type << " but its message lacks:" << missing
         << "\n  The message: " << msg;
}

}  // namespace detail
}  // namespace dtensor::testing

// EXPECT_ERROR(statement, ExceptionType, "part", ...): `statement` must throw ExceptionType (or a
// subclass) whose message contains each part; a vector<string> of parts may be passed instead.
// Fails when nothing is thrown, when another type is thrown, or when a part is missing, printing
// the message. ASSERT_ERROR also ends the test.
#define DTENSOR_ERROR_CHECK_(statement, type, on_failure, ...)                                     \
  GTEST_ASSERT_(::dtensor::testing::detail::throws_error<type>(#statement, #type,                  \
                                                               [&] { statement; }, {__VA_ARGS__}), \
                on_failure)
#define EXPECT_ERROR(statement, type, ...) \
  DTENSOR_ERROR_CHECK_(statement, type, GTEST_NONFATAL_FAILURE_, __VA_ARGS__)
#define ASSERT_ERROR(statement, type, ...) \
  DTENSOR_ERROR_CHECK_(statement, type, GTEST_FATAL_FAILURE_, __VA_ARGS__)

#define EXPECT_CONTAINS(text, part)                          \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "expected \"" << (part) << "\" in: " << (text)
