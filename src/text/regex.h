#pragma once
// A PCRE2 pattern in UTF + Unicode-properties mode (\p{L}, \s as Unicode classes), standing in
// for the Oniguruma regexes of HF `tokenizers`.
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

struct pcre2_real_code_8;

namespace dtensor::text {

/// A piece of a string: [begin, end), and whether the pattern matched it.
struct Span {
  size_t begin, end;
  bool match;
};

class Regex {
 public:
  /// `where` prefixes the compile error (names the file and key).
  Regex(const std::string& pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// `s` cut into the pattern's non-empty, non-overlapping matches (leftmost first) and the
  /// text between them, in order, covering every byte: HF's Pattern::find_matches.
  std::vector<Span> spans(std::string_view s) const;

 private:
  pcre2_real_code_8* code_ = nullptr;
};

}  // namespace dtensor::text
