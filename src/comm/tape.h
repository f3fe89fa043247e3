#pragma once
// The collectives' side of collective_tape.h.
#include <ATen/core/Tensor.h>

#include <functional>
#include <string>

#include "dtensor/comm/collective_tape.h"
#include "dtensor/comm/process_group.h"

namespace dtensor::comm::detail {

// Whether a recorder or a replay is open on this thread (a thread-local read).
bool tape_open();

// With a tape open: replays the next result (checking it is `what`), or runs `issue` (which
// returns the finished result) and records it. `what` describes the collective.
at::Tensor taped(const std::string& what, const std::function<at::Tensor()>& issue);

}  // namespace dtensor::comm::detail
