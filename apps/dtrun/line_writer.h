#pragma once
// Turns one rank's output stream into prefixed lines.
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "rank_errors.h"

namespace dtrun {

// Writes all of `s` to `fd`, retrying short writes. Output errors (a closed pipe) are ignored:
// the ranks keep running and their output is dropped.
void write_all(int fd, std::string_view s);

// Buffers the bytes of one stream (a rank's stdout or stderr) and writes them to `out_fd` one
// line at a time, each line in one write() and starting with `prefix` (empty: no prefix).
// '\r' ends a line like '\n' and is kept, so progress bars still redraw in place.
class LineWriter {
 public:
  LineWriter(int out_fd, std::string prefix) : out_fd_(out_fd), prefix_(std::move(prefix)) {}

  void feed(const char* data, size_t size);
  // End of the stream: writes what is left of an unterminated last line.
  void finish();

  // Rank `rank`'s stderr: its latest error line (rank_errors.h) is held back instead of
  // written, for dtrun to summarize at the end; a line that follows it writes it first.
  void hold_errors_of(int rank) { error_rank_ = rank; }
  std::optional<RankError> take_held_error() { return std::exchange(held_error_, std::nullopt); }

 private:
  // A line longer than this is written in pieces (only the first piece is prefixed).
  static constexpr size_t kMaxPending = 64 * 1024;

  void emit(std::string_view text, char terminator);  // terminator: '\n', '\r' or 0 (none)

  int out_fd_;
  std::string prefix_;
  std::string pending_;
  bool at_line_start_ = true;
  bool after_cr_ = false;
  std::optional<int> error_rank_;
  std::optional<RankError> held_error_;
};

}  // namespace dtrun
