#include "utf8.h"

#include <algorithm>

namespace dtensor::text {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t utf8_sequence(std::string_view s, size_t i, size_t* valid_prefix) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c < 0x80) {
    if (valid_prefix != nullptr) *valid_prefix = 1;
    return 1;
  }
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  }
  size_t ok = len == 0 ? 0 : 1;
  for (size_t k = 1; k < len && i + k < s.size(); ++k) {
    const unsigned char ck = b(k);
    if (ck < (k == 1 ? lo : 0x80) || ck > (k == 1 ? hi : 0xBF)) break;
    ++ok;
  }
  if (valid_prefix != nullptr) *valid_prefix = std::max<size_t>(ok, 1);
  return ok == len ? len : 0;
}

size_t utf8_invalid_at(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    size_t prefix = 1;
    const size_t n = utf8_sequence(bytes, i, &prefix);
    if (n > 0) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += prefix;
    }
  }
  return out;
}

std::vector<std::string_view> utf8_chars(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    const size_t n = std::max<size_t>(utf8_sequence(s, i), 1);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

uint32_t code_point(std::string_view c) {
  const auto u = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(c[k])); };
  switch (c.size()) {
    case 1:
      return u(0);
    case 2:
      return ((u(0) & 0x1F) << 6) | (u(1) & 0x3F);
    case 3:
      return ((u(0) & 0x0F) << 12) | ((u(1) & 0x3F) << 6) | (u(2) & 0x3F);
    default:
      return ((u(0) & 0x07) << 18) | ((u(1) & 0x3F) << 12) | ((u(2) & 0x3F) << 6) | (u(3) & 0x3F);
  }
}

bool is_whitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

}  // namespace dtensor::text
