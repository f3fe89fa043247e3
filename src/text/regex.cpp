#include "regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <stdexcept>

#include "utf8.h"

namespace dtensor::text {

Regex::Regex(const std::string& pattern, const std::string& where) {
  int code = 0;
  PCRE2_SIZE offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                        PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
  if (code_ == nullptr) {
    std::array<PCRE2_UCHAR, 256> buf{};
    pcre2_get_error_message(code, buf.data(), buf.size());
    throw std::invalid_argument(where + ": cannot compile the regex /" + pattern + "/ at offset " +
                                std::to_string(offset) + ": " +
                                reinterpret_cast<const char*>(buf.data()));
  }
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // optional speed-up; falls back silently
}

Regex::~Regex() { pcre2_code_free(code_); }

std::vector<Span> Regex::spans(std::string_view s) const {
  std::vector<Span> out;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
  size_t pos = 0, last = 0;
  while (pos <= s.size()) {
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                               PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(md);
      throw std::invalid_argument("tokenizer: regex matching failed with PCRE2 error " +
                                  std::to_string(rc));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e == b) {  // an empty match makes no piece: step over one character
      if (b >= s.size()) break;
      pos = b + std::max<size_t>(utf8_sequence(s, b), 1);
      continue;
    }
    if (b > last) out.push_back({last, b, false});
    out.push_back({b, e, true});
    last = pos = e;
  }
  if (last < s.size()) out.push_back({last, s.size(), false});
  pcre2_match_data_free(md);
  return out;
}

}  // namespace dtensor::text
