#pragma once
// Wall-clock readings for tests that bound how long something takes (a failed peer noticed, a
// timeout honoured): steady time, never the system clock.
#include <chrono>

namespace dtensor::testing {

inline std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(now() - t).count();
}

}  // namespace dtensor::testing
