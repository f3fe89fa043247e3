#include "normalizer.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <vector>

#include "regex.h"
#include "utf8.h"

namespace dtensor::text {

using nlohmann::json;

namespace {

constexpr std::string_view kSupported =
    "NFC, NFD, NFKC, NFKD, Lowercase, Strip, Replace, Prepend, Sequence";

// A Unicode normalization form by utf8proc (its Unicode version may differ from the one HF's
// Rust crate was built with for characters assigned since).
std::string unicode_normalize(std::string_view s, utf8proc_option_t form) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | form));
  if (n < 0) {
    throw std::invalid_argument(std::string("tokenizer: Unicode normalization failed: ") +
                                utf8proc_errmsg(n));
  }
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
  return std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
}

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
  if (type == "NFC")
    return [](std::string_view s) { return unicode_normalize(s, UTF8PROC_COMPOSE); };
  if (type == "NFD")
    return [](std::string_view s) { return unicode_normalize(s, UTF8PROC_DECOMPOSE); };
  if (type == "NFKC") {
    return [](std::string_view s) {
      return unicode_normalize(s,
                               static_cast<utf8proc_option_t>(UTF8PROC_COMPOSE | UTF8PROC_COMPAT));
    };
  }
  if (type == "NFKD") {
    return [](std::string_view s) {
      return unicode_normalize(
          s, static_cast<utf8proc_option_t>(UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT));
    };
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
