#pragma once
// The last words of failing ranks, said once. dtensor_train and dtensor_generate end a failed
// run with one line "NAME: error on rank R: MESSAGE" on stderr; when several ranks fail alike
// (a missing model directory), dtrun prints that line once, naming the ranks, instead of once
// per rank.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtrun {

struct RankError {
  int rank = 0;         // the rank whose stderr had the line
  std::string line;     // the whole line, as the rank wrote it
  std::string program;  // NAME
  std::string message;  // MESSAGE
};

// The parts of an error line, or nullopt when `line` is not one.
std::optional<RankError> parse_rank_error(int rank, std::string_view line);

// The lines to print for `errors` of a job of `world_size` ranks: one line per distinct
// (program, message), "NAME: error on every rank (N of N): MESSAGE" when every rank said it,
// "NAME: error on ranks 0, 2 (2 of 4): MESSAGE" when several did, and a line one rank alone said
// as it was, prefixed "[rank R] " when `prefix`. Ordered by the lowest rank of each.
std::vector<std::string> summarize_rank_errors(const std::vector<RankError>& errors, int world_size,
                                               bool prefix);

}  // namespace dtrun
