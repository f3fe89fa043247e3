#include "byte_level.h"

#include <array>
#include <cstdint>
#include <unordered_map>

#include "utf8.h"

namespace dtensor::text {

namespace {

struct ByteMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<uint32_t, char> to_byte;
  ByteMap() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      const uint32_t cp = printable ? b : next++;
      append_utf8(to_char[b], cp);
      to_byte.emplace(cp, static_cast<char>(b));
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

}  // namespace

std::string bytes_to_byte_level(std::string_view bytes) {
  const ByteMap& map = byte_map();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += map.to_char[static_cast<unsigned char>(c)];
  return out;
}

std::optional<std::string> byte_level_to_bytes(std::string_view token) {
  const ByteMap& map = byte_map();
  std::string out;
  for (std::string_view c : utf8_chars(token)) {
    const auto it = map.to_byte.find(code_point(c));
    if (it == map.to_byte.end()) return std::nullopt;
    out += it->second;
  }
  return out;
}

}  // namespace dtensor::text
