#include "tokenizer_json.h"

#include <stdexcept>

namespace dtensor::text {

using nlohmann::json;

JsonKey JsonKey::operator[](std::string_view child) const {
  return JsonKey(source_, key_.empty() ? std::string(child) : key_ + "." + std::string(child));
}

JsonKey JsonKey::operator[](size_t index) const {
  return JsonKey(source_, key_ + "[" + std::to_string(index) + "]");
}

void JsonKey::fail(const std::string& what) const {
  throw std::invalid_argument(where() + ": " + key_ + (key_.empty() ? "" : " ") + what);
}

void JsonKey::unsupported(const json& value, std::string_view supported) const {
  fail(value.dump() + " is not supported; supported: " + std::string(supported));
}

std::string type_of(const json& j) {
  const auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string("?");
}

bool flag(const json& j, const char* key, bool fallback) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<bool>();
}

std::string string_at(const json& j, const char* key, const JsonKey& at) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_string()) at[key].fail("must be a string");
  return it->get<std::string>();
}

std::string pattern_of(const json& pattern, const JsonKey& at) {
  if (pattern.is_object() && pattern.contains("Regex")) return string_at(pattern, "Regex", at);
  if (pattern.is_object() && pattern.contains("String")) {
    const std::string literal = string_at(pattern, "String", at);
    if (literal.empty()) at["String"].fail("is empty");
    // \Q...\E quotes the literal, except a "\E" inside it, which is spelled out.
    std::string out = "\\Q";
    for (size_t i = 0; i < literal.size(); ++i) {
      if (literal.compare(i, 2, "\\E") == 0) {
        out += "\\E\\\\E\\Q";
        ++i;
      } else {
        out += literal[i];
      }
    }
    return out + "\\E";
  }
  at.fail("must be {\"String\": ...} or {\"Regex\": ...}");
}

}  // namespace dtensor::text
