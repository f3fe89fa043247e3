#pragma once
// Comm-internal: what a failed collective runs before it throws: it asks the group's other
// members (through the store) where they are, and names the rank that is missing, the first
// collective where the ranks diverge, or the peer that failed first.
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "health_state.h"

namespace dtensor::comm::detail {

// Lines naming what each member of `group` reported, and the first collective where the
// members' fingerprints differ.
std::string compare_histories(const std::string& label, int self, const History& mine,
                              const std::map<int, History>& others, const std::vector<int>& silent,
                              std::chrono::milliseconds waited);

// head + the diagnosis of the collective `c` + tail, reported to the other ranks, computed
// aside: a call on a store whose host is cut off can block without a timeout. After `wait` the
// message names the group's other members as unreachable instead.
std::string bounded_diagnosis(const WorkContext& c, const std::string& head,
                              const std::string& tail, std::chrono::milliseconds wait);

}  // namespace dtensor::comm::detail
