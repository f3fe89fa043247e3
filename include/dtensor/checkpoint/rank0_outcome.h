#pragma once
// Work that only global rank 0 does (writing a file) while every rank must return together
// and agree on the result: one broadcast of rank 0's outcome.
#include <exception>
#include <string>

namespace dtensor::checkpoint::detail {

/// Collective over the world (a no-op without a process group or with one rank). Rank 0
/// passes the error its work raised (or nullptr); every rank then throws when rank 0 failed:
/// rank 0 its own exception, the others an error carrying rank 0's message and `what`.
void share_rank0_outcome(std::exception_ptr error_on_rank0, const std::string& what);

/// Global rank (0 without a process group).
int global_rank();

}  // namespace dtensor::checkpoint::detail
