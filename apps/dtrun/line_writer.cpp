#include "line_writer.h"

#include <unistd.h>

#include <cerrno>

namespace dtrun {

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    ssize_t n = ::write(fd, s.data(), s.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    s.remove_prefix(static_cast<size_t>(n));
  }
}

void LineWriter::feed(const char* data, size_t size) {
  pending_.append(data, size);
  size_t start = 0;
  for (size_t end; (end = pending_.find_first_of("\r\n", start)) != std::string::npos;
       start = end + 1) {
    emit(std::string_view(pending_).substr(start, end - start), pending_[end]);
  }
  pending_.erase(0, start);
  if (pending_.size() >= kMaxPending) {
    emit(pending_, 0);
    pending_.clear();
  }
}

void LineWriter::finish() {
  if (prefix_.empty()) {
    // Without prefixes the output is passed through unchanged.
    if (!pending_.empty()) emit(pending_, 0);
  } else if (!pending_.empty()) {
    emit(pending_, '\n');
  } else if (!at_line_start_) {
    emit({}, '\n');
  }
  pending_.clear();
}

void LineWriter::emit(std::string_view text, char terminator) {
  if (error_rank_) {
    if (held_error_) {
      write_all(out_fd_, prefix_ + held_error_->line + "\n");
      held_error_.reset();
    }
    if (at_line_start_ && terminator == '\n') {
      held_error_ = parse_rank_error(*error_rank_, text);
      if (held_error_) {
        after_cr_ = false;
        return;
      }
    }
  }
  // No prefix before the '\n' of a "\r\n" pair, nor for a bare '\r': both only move the cursor.
  bool cursor_only = text.empty() && (terminator == '\r' || (terminator == '\n' && after_cr_));
  std::string line;
  line.reserve(prefix_.size() + text.size() + 1);
  if (at_line_start_ && !cursor_only) line += prefix_;
  line += text;
  if (terminator) line += terminator;
  write_all(out_fd_, line);
  at_line_start_ = terminator != 0;
  after_cr_ = terminator == '\r';
}

}  // namespace dtrun
