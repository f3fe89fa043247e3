#pragma once
// Comm-internal: what this rank says when it ends: the terminate handler's one line for an
// uncaught exception, the message of a call that cannot be cancelled and has to end the
// process, the line a launcher's SIGTERM prints while such a call blocks, and the failure it
// reports to the other ranks (comm::report_failure, failure.h).
#include <string>

#include "health_state.h"

namespace dtensor::comm::detail {

// The terminate handler (installed by health_prepare): the uncaught exception as this rank's
// failure, printed once and without a stack trace, reported to the other ranks.
[[noreturn]] void on_terminate();
// Ends the process for a thread stuck in `b`: `peer_failure` when another rank failed, else
// the timeout passed.
[[noreturn]] void end_blocked(const Blocked& b, const std::string& peer_failure);
// What a SIGTERM from the launcher prints while the thread in a BlockingSection doing `what`
// is blocked; clear_last_words() once no thread is.
void set_last_words(const std::string& what);
void clear_last_words();

}  // namespace dtensor::comm::detail
