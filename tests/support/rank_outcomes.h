#pragma once
// For fault tests: run ranks without stopping the others when one fails, and see how and when
// each one ended.
#include <functional>
#include <string>
#include <vector>

#include "support/distributed.h"

namespace dtensor::testing {

struct RankOutcome {
  int status = -1;      // as from waitpid
  std::string message;  // what the rank's harness reported ("rank R threw: ...")
  double seconds = 0;   // from the start of the run to the rank's exit
  bool hung = false;    // still running at RunOptions::timeout (then killed)
};

// Like run_ranks, but waits for every rank on its own (up to options.timeout) and reports.
std::vector<RankOutcome> run_ranks_collect(int world_size, const std::function<void(int)>& body,
                                           const RunOptions& options);

// One line per rank: how it ended (exit code, signal or HUNG), when, and its message.
std::string describe_outcomes(const std::vector<RankOutcome>& out);

}  // namespace dtensor::testing
