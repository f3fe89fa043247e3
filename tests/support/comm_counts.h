#pragma once
// Shorthands for asserting whole collective-count maps:
//   EXPECT_EQ(comm.get_comm_counts(), counts({{AR, 1}, {AG, 2}}));
// (a braced map cannot be a macro argument by itself: its commas split it).
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "dtensor/comm/comm_debug_mode.h"

namespace dtensor::testing {

inline CommCounts counts(std::initializer_list<std::pair<const CommType, int64_t>> l) {
  return CommCounts(l);
}
inline constexpr CommType AR = CommType::all_reduce;
inline constexpr CommType AG = CommType::all_gather_into_tensor;
inline constexpr CommType RS = CommType::reduce_scatter_tensor;

}  // namespace dtensor::testing
