#pragma once
// Making one rank's failure every rank's failure.
//
// While a process group exists, a rank that fails writes "rank R failed: <message>" to the
// store; a watchdog thread on every other rank sees it within a few hundred milliseconds and
// makes the collective it is blocked in (or the next one it enters) throw, naming the failed
// rank, its error and the collective. Uncaught exceptions (std::terminate) and collectives that
// fail on this rank are reported automatically; call report_failure() from a catch block that
// ends the program some other way.
//
// DTENSOR_CHECK_COLLECTIVES=1 compares every collective's fingerprint (sequence number, op,
// dtype, shape) across the group through the store before issuing it: slow, for debugging
// ranks that issue different collectives.
#include <string>

namespace dtensor::comm {

/// Tells every other rank that this one failed (a no-op without a process group, and after the
/// first call); this rank's own later collectives fail at once, naming it. Never throws.
void report_failure(const std::string& message);

}  // namespace dtensor::comm
