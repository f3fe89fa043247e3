#pragma once
// UTF-8 helpers of the tokenizers: well-formedness as Unicode's table 3-7 defines it, Rust's
// from_utf8_lossy, and char::is_whitespace, which HF `tokenizers` (Rust) relies on.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor::text {

void append_utf8(std::string& out, uint32_t cp);

/// Length of the well-formed UTF-8 sequence at s[i], or 0 if there is none; `valid_prefix`
/// gets how many of its bytes are a valid start (a maximal subpart).
size_t utf8_sequence(std::string_view s, size_t i, size_t* valid_prefix = nullptr);

/// Byte offset of the first ill-formed sequence, or npos.
size_t utf8_invalid_at(std::string_view s);

/// Rust's String::from_utf8_lossy: each maximal invalid subpart becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

/// The characters of `s` (valid UTF-8), each as its bytes.
std::vector<std::string_view> utf8_chars(std::string_view s);

/// The code point of one well-formed character.
uint32_t code_point(std::string_view c);

/// Rust's char::is_whitespace (the Unicode White_Space property).
bool is_whitespace(uint32_t cp);

}  // namespace dtensor::text
