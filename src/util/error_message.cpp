#include "dtensor/util/error_message.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace dtensor::util {

bool show_cpp_stacktraces() {
  for (const char* name : {"DTENSOR_SHOW_CPP_STACKTRACES", "TORCH_SHOW_CPP_STACKTRACES"}) {
    const char* v = std::getenv(name);
    if (v && std::strcmp(v, "1") == 0) return true;
  }
  return false;
}

std::string error_message(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e); c && !show_cpp_stacktraces()) {
    return c->what_without_backtrace();
  }
  return e.what();
}

std::string error_message(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& err) {
    return error_message(err);
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace dtensor::util
