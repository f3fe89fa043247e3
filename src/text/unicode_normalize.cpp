#include "unicode_normalize.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <utility>

#include "utf8.h"

namespace dtensor::text {

namespace {

// Sorted, disjoint [first, last] ranges, made by scripts/make-hf-unicode-table.
constexpr std::pair<char32_t, char32_t> kHfRanges[] = {
#include "hf_unicode_table.inc"
};

utf8proc_option_t options_of(NormalizationForm form) {
  switch (form) {
    case NormalizationForm::NFC:
      return UTF8PROC_COMPOSE;
    case NormalizationForm::NFD:
      return UTF8PROC_DECOMPOSE;
    case NormalizationForm::NFKC:
      return static_cast<utf8proc_option_t>(UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
    case NormalizationForm::NFKD:
      return static_cast<utf8proc_option_t>(UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  }
  throw std::logic_error("unicode_normalize: unknown form");
}

void append_utf8proc(std::string& out, std::string_view s, utf8proc_option_t options) {
  if (s.empty()) return;
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(
      reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
      &mapped, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | options));
  if (n < 0) {
    throw std::invalid_argument(std::string("tokenizer: Unicode normalization failed: ") +
                                utf8proc_errmsg(n));
  }
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(mapped, &std::free);
  out.append(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
}

// Whether HF's tables give `cp` a combining class or a decomposition, or `cp` appears in one of
// their decompositions; any other code point is a starter normalization leaves alone.
bool hf_has_normalization_data(char32_t cp) {
  if (cp <= kHfRanges[0].second) return true;  // the first range starts at 0 (ASCII, Latin...)
  const auto* after = std::upper_bound(
      std::begin(kHfRanges), std::end(kHfRanges), cp,
      [](char32_t c, const std::pair<char32_t, char32_t>& r) { return c < r.first; });
  return after != std::begin(kHfRanges) && cp <= std::prev(after)->second;
}

}  // namespace

std::string unicode_normalize(std::string_view s, NormalizationForm form) {
  const utf8proc_option_t options = options_of(form);
  // A character HF has no data for is a starter that neither composes nor decomposes, so the
  // text normalizes as the pieces between such characters, each on its own.
  std::string out;
  out.reserve(s.size());
  size_t piece = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence(s, i);
    if (n == 0) break;  // utf8proc names the error below
    if (!hf_has_normalization_data(code_point(s.substr(i, n)))) {
      append_utf8proc(out, s.substr(piece, i - piece), options);
      out.append(s.substr(i, n));
      piece = i + n;
    }
    i += n;
  }
  append_utf8proc(out, s.substr(piece), options);
  return out;
}

}  // namespace dtensor::text
