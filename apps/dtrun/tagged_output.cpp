#include "tagged_output.h"

#include <unistd.h>

#include <cctype>
#include <string_view>

namespace dtrun {

TaggedOutput::TaggedOutput(int nproc, bool prefix)
    : nproc_(nproc), launcher_out_(STDOUT_FILENO, ""), launcher_err_(STDERR_FILENO, "") {
  for (int r = 0; r < nproc; ++r) {
    const std::string p = prefix ? "[rank " + std::to_string(r) + "] " : "";
    ranks_.push_back(std::make_unique<LineWriter>(STDOUT_FILENO, p));
    ranks_.push_back(std::make_unique<LineWriter>(STDERR_FILENO, p));
    if (prefix) ranks_.back()->hold_errors_of(r);
  }
  parsers_[0].target = &launcher_out_;
  parsers_[1].target = &launcher_err_;
}

long TaggedOutput::match_tag(const std::string& text, size_t at, int* rank, int* stream) {
  // "[" digits "," digits "]<" name ">:"
  size_t i = at;
  const size_t n = text.size();
  auto digits = [&](long* value) -> int {  // 1 matched, 0 no match, -1 ran out of text
    const size_t start = i;
    *value = 0;
    while (i < n && std::isdigit(static_cast<unsigned char>(text[i])) && i - start < 9) {
      *value = *value * 10 + (text[i] - '0');
      ++i;
    }
    if (i == n) return -1;
    return i > start ? 1 : 0;
  };
  auto literal = [&](std::string_view s) -> int {
    for (char c : s) {
      if (i == n) return -1;
      if (text[i] != c) return 0;
      ++i;
    }
    return 1;
  };
  long job = 0, r = 0;
  int m = literal("[");
  if (m > 0) m = digits(&job);
  if (m > 0) m = literal(",");
  if (m > 0) m = digits(&r);
  if (m > 0) m = literal("]<");
  if (m <= 0) return m;
  static constexpr std::string_view kNames[] = {"stdout>:", "stderr>:", "stddiag>:"};
  const size_t name_at = i;
  bool may_continue = false;
  for (size_t k = 0; k < 3; ++k) {
    i = name_at;
    m = literal(kNames[k]);
    if (m == 1) {
      *rank = static_cast<int>(r);
      *stream = k == 0 ? 0 : 1;
      return static_cast<long>(i - at);
    }
    may_continue = may_continue || m < 0;
  }
  return may_continue ? -1 : 0;
}

void TaggedOutput::feed(int stream, const char* data, size_t size) {
  Parser& p = parsers_[stream];
  std::string text = std::move(p.carry);
  p.carry.clear();
  text.append(data, size);
  size_t written = 0;
  for (size_t at = text.find('['); at != std::string::npos; at = text.find('[', at + 1)) {
    int rank = -1, to = 0;
    const long len = match_tag(text, at, &rank, &to);
    if (len == 0) continue;
    p.target->feed(text.data() + written, at - written);
    if (len < 0) {  // wait for the rest of the tag
      p.carry = text.substr(at);
      return;
    }
    p.target = rank >= 0 && rank < nproc_ ? ranks_[2 * rank + to].get()
                                          : (to == 0 ? &launcher_out_ : &launcher_err_);
    written = at + static_cast<size_t>(len);
    at = written - 1;
  }
  p.target->feed(text.data() + written, text.size() - written);
}

void TaggedOutput::finish(int stream) {
  Parser& p = parsers_[stream];
  if (!p.carry.empty()) p.target->feed(p.carry.data(), p.carry.size());
  p.carry.clear();
  // Every writer of this stream ends its unterminated last line.
  (stream == 0 ? launcher_out_ : launcher_err_).finish();
  for (int r = 0; r < nproc_; ++r) ranks_[2 * r + stream]->finish();
}

}  // namespace dtrun
