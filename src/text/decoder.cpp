#include "decoder.h"

#include <memory>
#include <optional>
#include <utility>

#include "byte_level.h"
#include "regex.h"
#include "utf8.h"

namespace dtensor::text {

using nlohmann::json;

namespace {

constexpr std::string_view kSupported =
    "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence";

// A token written "<0xAB>" (SentencePiece's byte pieces) as its byte.
std::optional<char> byte_token(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return std::nullopt;
  int value = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = t[i];
    int d = 0;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    value = value * 16 + d;
  }
  return static_cast<char>(value);
}

// Runs of byte tokens become their text when the run is UTF-8, else one U+FFFD per byte.
std::vector<std::string> byte_fallback(std::vector<std::string> tokens) {
  std::vector<std::string> out;
  std::string run;
  size_t run_tokens = 0;
  const auto flush = [&] {
    if (run_tokens == 0) return;
    if (utf8_invalid_at(run) == std::string::npos) {
      out.push_back(run);
    } else {
      for (size_t i = 0; i < run_tokens; ++i) out.emplace_back("\xEF\xBF\xBD");
    }
    run.clear();
    run_tokens = 0;
  };
  for (std::string& t : tokens) {
    if (const auto b = byte_token(t)) {
      run += *b;
      ++run_tokens;
    } else {
      flush();
      out.push_back(std::move(t));
    }
  }
  flush();
  return out;
}

// HF's Strip: up to `start` leading and `stop` trailing `content` characters off each token.
std::vector<std::string> strip(std::vector<std::string> tokens, const std::string& content,
                               size_t start, size_t stop) {
  for (std::string& t : tokens) {
    const std::vector<std::string_view> chars = utf8_chars(t);
    size_t b = 0, e = chars.size();
    while (b < start && b < e && chars[b] == content) ++b;
    for (size_t i = 0; i < stop && e > b && chars[e - 1] == content; ++i) --e;
    std::string kept;
    for (size_t i = b; i < e; ++i) kept += chars[i];
    t = std::move(kept);
  }
  return tokens;
}

}  // namespace

Decoder make_decoder(const json& j, const JsonKey& at) {
  if (j.is_null()) return {};
  if (!j.is_object()) at.fail("must be an object or null");
  const std::string type = type_of(j);
  if (type == "ByteLevel") {
    // Tokens of byte-level characters stand for those bytes; any other token (an added token
    // such as "<|im_end|>" maps too, being printable ASCII) for its own UTF-8.
    return [](std::vector<std::string> tokens) {
      std::string bytes;
      for (const std::string& t : tokens) {
        const auto b = byte_level_to_bytes(t);
        bytes += b ? *b : t;
      }
      return std::vector<std::string>{utf8_lossy(bytes)};
    };
  }
  if (type == "Replace") {
    auto re = std::make_shared<const Regex>(pattern_of(j.at("pattern"), at["pattern"]),
                                            at.where() + ": " + at.key() + ".pattern");
    const std::string content = string_at(j, "content", at);
    return [re, content](std::vector<std::string> tokens) {
      for (std::string& t : tokens) {
        std::string out;
        for (const Span& p : re->spans(t))
          out += p.match ? std::string_view(content)
                         : std::string_view(t).substr(p.begin, p.end - p.begin);
        t = std::move(out);
      }
      return tokens;
    };
  }
  if (type == "ByteFallback") return byte_fallback;
  if (type == "Fuse") {
    return [](std::vector<std::string> tokens) {
      std::string all;
      for (const std::string& t : tokens) all += t;
      return std::vector<std::string>{all};
    };
  }
  if (type == "Strip") {
    const std::string content = string_at(j, "content", at);
    if (utf8_chars(content).size() != 1) at["content"].fail("must be one character");
    const size_t start = j.value("start", size_t{0}), stop = j.value("stop", size_t{0});
    return [content, start, stop](std::vector<std::string> tokens) {
      return strip(std::move(tokens), content, start, stop);
    };
  }
  if (type == "Metaspace") {
    // The replacement character becomes a space, except in the first token, where it is
    // dropped unless prepend_scheme is "never" (the encoder put it there).
    const std::string replacement = string_at(j, "replacement", at);
    if (utf8_chars(replacement).size() != 1) at["replacement"].fail("must be one character");
    const auto scheme = j.find("prepend_scheme");
    const bool never = scheme != j.end() && !scheme->is_null()
                           ? scheme->get<std::string>() == "never"
                           : !flag(j, "add_prefix_space", true);
    return [replacement, never](std::vector<std::string> tokens) {
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string out;
        for (std::string_view c : utf8_chars(tokens[i])) {
          if (c != replacement) {
            out += c;
          } else if (i > 0 || never) {
            out += ' ';
          }
        }
        tokens[i] = std::move(out);
      }
      return tokens;
    };
  }
  if (type == "Sequence") {
    const auto it = j.find("decoders");
    if (it == j.end() || !it->is_array()) at["decoders"].fail("must be an array");
    std::vector<Decoder> steps;
    for (size_t i = 0; i < it->size(); ++i) {
      Decoder d = make_decoder((*it)[i], at["decoders"][i]);
      if (d) steps.push_back(std::move(d));
    }
    return [steps](std::vector<std::string> tokens) {
      for (const auto& d : steps) tokens = d(std::move(tokens));
      return tokens;
    };
  }
  at["type"].unsupported(j.contains("type") ? j.at("type") : json("?"), kSupported);
}

}  // namespace dtensor::text
