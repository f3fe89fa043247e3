#include "rank_errors.h"

#include <algorithm>
#include <cctype>

namespace dtrun {

std::optional<RankError> parse_rank_error(int rank, std::string_view line) {
  constexpr std::string_view kMarker = ": error on rank ";
  const size_t at = line.find(kMarker);
  if (at == std::string_view::npos || at == 0) return std::nullopt;
  const std::string_view program = line.substr(0, at);
  if (std::ranges::any_of(program,
                          [](char c) { return std::isspace(static_cast<unsigned char>(c)); }))
    return std::nullopt;
  size_t i = at + kMarker.size();
  const size_t digits = i;
  while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) ++i;
  if (i == digits || line.substr(i, 2) != ": ") return std::nullopt;
  return RankError{rank, std::string(line), std::string(program), std::string(line.substr(i + 2))};
}

std::vector<std::string> summarize_rank_errors(const std::vector<RankError>& errors, int world_size,
                                               bool prefix) {
  std::vector<RankError> sorted = errors;
  std::ranges::stable_sort(sorted, {}, &RankError::rank);
  std::vector<bool> done(sorted.size(), false);
  std::vector<std::string> lines;
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (done[i]) continue;
    std::vector<int> ranks;
    for (size_t j = i; j < sorted.size(); ++j) {
      if (done[j] || sorted[j].program != sorted[i].program ||
          sorted[j].message != sorted[i].message)
        continue;
      done[j] = true;
      ranks.push_back(sorted[j].rank);
    }
    const RankError& e = sorted[i];
    if (ranks.size() == 1) {
      lines.push_back((prefix ? "[rank " + std::to_string(e.rank) + "] " : std::string()) + e.line);
      continue;
    }
    std::string who;
    if (static_cast<int>(ranks.size()) == world_size) {
      who = "every rank";
    } else {
      who = "ranks ";
      for (size_t k = 0; k < ranks.size(); ++k) who += (k ? ", " : "") + std::to_string(ranks[k]);
    }
    lines.push_back(e.program + ": error on " + who + " (" + std::to_string(ranks.size()) + " of " +
                    std::to_string(world_size) + "): " + e.message);
  }
  return lines;
}

}  // namespace dtrun
