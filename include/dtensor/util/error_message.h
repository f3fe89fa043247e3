#pragma once
// What a person reads when something fails: an error's message without LibTorch's C++ stack
// trace. c10::Error::what() appends "Exception raised from ... (most recent call first)" and
// dozens of frames, which bury the one line that says what went wrong; every error the library
// passes on to other ranks, and every error our programs print, goes through here.
//
// DTENSOR_SHOW_CPP_STACKTRACES=1 (or LibTorch's own TORCH_SHOW_CPP_STACKTRACES=1) keeps the
// trace, for debugging the library itself.
#include <exception>
#include <string>

namespace dtensor::util {

/// The message of `e`: c10::Error::what_without_backtrace() for LibTorch's errors, what() for
/// others; the full what() when stack traces are asked for.
std::string error_message(const std::exception& e);
/// The same for a captured exception ("unknown error" for one that is not a std::exception).
std::string error_message(const std::exception_ptr& e);
/// True when DTENSOR_SHOW_CPP_STACKTRACES or TORCH_SHOW_CPP_STACKTRACES is set to 1.
bool show_cpp_stacktraces();

}  // namespace dtensor::util
