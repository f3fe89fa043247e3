#include "pre_tokenizer.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "byte_level.h"
#include "regex.h"

namespace dtensor::text {

using nlohmann::json;

namespace {

constexpr std::string_view kSupported = "Split, ByteLevel, Metaspace, Sequence";

// The pattern ByteLevel's use_regex applies (GPT-2's).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// HF's NormalizedString::split: the spans regrouped by the delimiter behavior, as [begin, end)
// ranges to keep.
std::vector<std::pair<size_t, size_t>> regroup(std::vector<Span> spans, Behavior behavior,
                                               bool invert) {
  if (invert) {
    for (Span& s : spans) s.match = !s.match;
  }
  std::vector<std::pair<size_t, size_t>> out;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::Isolated:
      for (const Span& s : spans) out.emplace_back(s.begin, s.end);
      break;
    case Behavior::Removed:
      for (const Span& s : spans)
        if (!s.match) out.emplace_back(s.begin, s.end);
      break;
    case Behavior::Contiguous:
      for (const Span& s : spans) {
        if (s.match == previous_match && !out.empty()) {
          out.back().second = s.end;
        } else {
          out.emplace_back(s.begin, s.end);
        }
        previous_match = s.match;
      }
      break;
    case Behavior::MergedWithPrevious:
      for (const Span& s : spans) {
        if (s.match && !previous_match && !out.empty()) {
          out.back().second = s.end;
        } else {
          out.emplace_back(s.begin, s.end);
        }
        previous_match = s.match;
      }
      break;
    case Behavior::MergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !out.empty()) {
          out.back().first = it->begin;
        } else {
          out.emplace_back(it->begin, it->end);
        }
        previous_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  return out;
}

// Cuts every piece with `re`; a sub-piece starts the text only where its piece did and it
// begins that piece.
void split_all(std::vector<PreToken>& pieces, const Regex& re, Behavior behavior, bool invert) {
  std::vector<PreToken> next;
  for (PreToken& p : pieces) {
    for (const auto& [b, e] : regroup(re.spans(p.text), behavior, invert)) {
      if (e > b) next.push_back({p.text.substr(b, e - b), p.at_start && b == 0});
    }
  }
  pieces.swap(next);
}

Behavior behavior_of(const json& j, const JsonKey& at) {
  const std::string b = string_at(j, "behavior", at);
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  at["behavior"].unsupported(j.at("behavior"),
                             "Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

enum class Prepend { Always, First, Never };

// prepend_scheme, or the older add_prefix_space flag (true: always) that files written before
// tokenizers 0.14 carry.
Prepend prepend_scheme_of(const json& j, const JsonKey& at) {
  const auto it = j.find("prepend_scheme");
  if (it == j.end() || it->is_null())
    return flag(j, "add_prefix_space", true) ? Prepend::Always : Prepend::Never;
  const std::string s = string_at(j, "prepend_scheme", at);
  if (s == "always") return Prepend::Always;
  if (s == "first") return Prepend::First;
  if (s == "never") return Prepend::Never;
  at["prepend_scheme"].unsupported(*it, "always, first, never");
}

std::string replacement_of(const json& j, const JsonKey& at) {
  const std::string r = string_at(j, "replacement", at);
  if (r.empty()) at["replacement"].fail("is empty");
  return r;
}

std::string replace_spaces(const std::string& s, const std::string& with) {
  std::string out;
  out.reserve(s.size() + 8);
  for (char c : s) {
    if (c == ' ') {
      out += with;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

PreTokenizer make_pre_tokenizer(const json& j, const JsonKey& at) {
  if (j.is_null()) return {};
  if (!j.is_object()) at.fail("must be an object or null");
  const std::string type = type_of(j);
  if (type == "Sequence") {
    const auto it = j.find("pretokenizers");
    if (it == j.end() || !it->is_array()) at["pretokenizers"].fail("must be an array");
    std::vector<PreTokenizer> steps;
    for (size_t i = 0; i < it->size(); ++i) {
      PreTokenizer p = make_pre_tokenizer((*it)[i], at["pretokenizers"][i]);
      if (p) steps.push_back(std::move(p));
    }
    return [steps](std::vector<PreToken>& pieces) {
      for (const auto& p : steps) p(pieces);
    };
  }
  if (type == "Split") {
    const Behavior behavior = behavior_of(j, at);
    const bool invert = flag(j, "invert", false);
    const auto pattern = j.find("pattern");
    if (pattern == j.end()) at["pattern"].fail("is missing");
    auto re = std::make_shared<const Regex>(pattern_of(*pattern, at["pattern"]),
                                            at.where() + ": " + at.key() + ".pattern");
    return [re, behavior, invert](std::vector<PreToken>& pieces) {
      split_all(pieces, *re, behavior, invert);
    };
  }
  if (type == "ByteLevel") {
    const bool prefix_space = flag(j, "add_prefix_space", false);
    std::shared_ptr<const Regex> re;
    if (flag(j, "use_regex", true))
      re = std::make_shared<const Regex>(kGpt2Pattern, at.where() + ": " + at.key());
    return [prefix_space, re](std::vector<PreToken>& pieces) {
      if (prefix_space) {
        for (PreToken& p : pieces)
          if (p.text.front() != ' ') p.text.insert(0, 1, ' ');
      }
      if (re) split_all(pieces, *re, Behavior::Isolated, false);
      for (PreToken& p : pieces) p.text = bytes_to_byte_level(p.text);
    };
  }
  if (type == "Metaspace") {
    const std::string replacement = replacement_of(j, at);
    const Prepend scheme = prepend_scheme_of(j, at);
    const bool split = flag(j, "split", true);
    auto re = std::make_shared<const Regex>(pattern_of(json{{"String", replacement}}, at),
                                            at.where() + ": " + at.key());
    return [replacement, scheme, split, re](std::vector<PreToken>& pieces) {
      for (PreToken& p : pieces) {
        p.text = replace_spaces(p.text, replacement);
        const bool starts = p.text.compare(0, replacement.size(), replacement) == 0;
        if (!starts && (scheme == Prepend::Always || (scheme == Prepend::First && p.at_start)))
          p.text.insert(0, replacement);
      }
      if (split) split_all(pieces, *re, Behavior::MergedWithNext, false);
    };
  }
  at["type"].unsupported(j.contains("type") ? j.at("type") : json("?"), kSupported);
}

}  // namespace dtensor::text
