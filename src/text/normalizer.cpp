#include "normalizer.h"

#include <utf8proc.h>

#include <memory>
#include <utility>
#include <vector>

#include "regex.h"
#include "unicode_normalize.h"
#include "utf8.h"

namespace dtensor::text {

using nlohmann::json;

namespace {

constexpr std::string_view kSupported =
    "NFC, NFD, NFKC, NFKD, Lowercase, Strip, Replace, Prepend, Sequence";

// Rust's char::to_lowercase, character by character as HF does: the simple mapping, except
// U+0130 (İ), whose full lowercase is "i" + U+0307, the one unconditional special casing.
std::string lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::string_view c : utf8_chars(s)) {
    const uint32_t cp = code_point(c);
    if (cp == 0x130) {
      out += "i\xCC\x87";
    } else {
      append_utf8(out, static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
    }
  }
  return out;
}

std::string strip(std::string_view s, bool left, bool right) {
  const std::vector<std::string_view> chars = utf8_chars(s);
  size_t b = 0, e = chars.size();
  while (left && b < e && is_whitespace(code_point(chars[b]))) ++b;
  while (right && e > b && is_whitespace(code_point(chars[e - 1]))) --e;
  if (b == e) return {};
  const size_t begin = static_cast<size_t>(chars[b].data() - s.data());
  const size_t end = static_cast<size_t>(chars[e - 1].data() - s.data()) + chars[e - 1].size();
  return std::string(s.substr(begin, end - begin));
}

}  // namespace

Normalizer make_normalizer(const json& j, const JsonKey& at) {
  if (j.is_null()) return {};
  if (!j.is_object()) at.fail("must be an object or null");
  const std::string type = type_of(j);
  for (const auto& [name, form] :
       {std::pair{"NFC", NormalizationForm::NFC}, std::pair{"NFD", NormalizationForm::NFD},
        std::pair{"NFKC", NormalizationForm::NFKC}, std::pair{"NFKD", NormalizationForm::NFKD}}) {
    if (type == name) return [form](std::string_view s) { return unicode_normalize(s, form); };
  }
  if (type == "Lowercase") return lowercase;
  if (type == "Strip") {
    const bool left = flag(j, "strip_left", true), right = flag(j, "strip_right", true);
    return [left, right](std::string_view s) { return strip(s, left, right); };
  }
  if (type == "Prepend") {
    const std::string prepend = string_at(j, "prepend", at);
    // HF prepends to non-empty strings only.
    return [prepend](std::string_view s) {
      return s.empty() ? std::string() : prepend + std::string(s);
    };
  }
  if (type == "Replace") {
    auto re = std::make_shared<const Regex>(pattern_of(j.at("pattern"), at["pattern"]),
                                            at.where() + ": " + at.key() + ".pattern");
    const std::string content = string_at(j, "content", at);
    return [re, content](std::string_view s) {
      std::string out;
      for (const Span& p : re->spans(s))
        out += p.match ? std::string_view(content) : s.substr(p.begin, p.end - p.begin);
      return out;
    };
  }
  if (type == "Sequence") {
    const auto it = j.find("normalizers");
    if (it == j.end() || !it->is_array()) at["normalizers"].fail("must be an array");
    std::vector<Normalizer> steps;
    for (size_t i = 0; i < it->size(); ++i) {
      Normalizer n = make_normalizer((*it)[i], at["normalizers"][i]);
      if (n) steps.push_back(std::move(n));
    }
    return [steps](std::string_view s) {
      std::string cur(s);
      for (const auto& n : steps) cur = n(cur);
      return cur;
    };
  }
  at["type"].unsupported(j.contains("type") ? j.at("type") : json("?"), kSupported);
}

}  // namespace dtensor::text
