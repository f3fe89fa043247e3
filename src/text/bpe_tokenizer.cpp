// Byte-level BPE as HF `tokenizers` runs it: added tokens are split out first, every other
// piece is pre-tokenized (regex splits, then bytes mapped to printable characters), each
// pre-token is merged by merge rank, and the post-processor's template adds special tokens.
#include "dtensor/text/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <variant>

namespace dtensor::text {

namespace {

using nlohmann::json;

// The pattern ByteLevel's use_regex applies (GPT-2's).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

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

// Length of the well-formed UTF-8 sequence at s[i] (Unicode's table 3-7), or 0 if there is
// none; `valid_prefix` gets how many of its bytes are a valid start (a maximal subpart).
size_t utf8_sequence(std::string_view s, size_t i, size_t* valid_prefix = nullptr) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c < 0x80) return 1;
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

// Rust's String::from_utf8_lossy: each maximal invalid subpart becomes one U+FFFD.
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

// The UTF-8 characters of `s` (which is valid UTF-8).
std::vector<std::string_view> utf8_chars(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    const size_t n = std::max<size_t>(utf8_sequence(s, i), 1);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

uint32_t decode_one(std::string_view c) {
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

// GPT-2's map from bytes to printable characters: printable Latin-1 bytes map to themselves,
// the others to U+0100 onwards in byte order.
struct ByteMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<uint32_t, uint8_t> to_byte;
  ByteMap() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      const uint32_t cp = printable ? b : next++;
      append_utf8(to_char[b], cp);
      to_byte.emplace(cp, static_cast<uint8_t>(b));
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

// A compiled PCRE2 pattern in UTF + Unicode-properties mode.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int code = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
    if (code_ == nullptr) {
      std::array<PCRE2_UCHAR, 256> buf{};
      pcre2_get_error_message(code, buf.data(), buf.size());
      throw std::invalid_argument(where + ": cannot compile the regex /" + pattern +
                                  "/ at offset " + std::to_string(offset) + ": " +
                                  reinterpret_cast<const char*>(buf.data()));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // optional speed-up; falls back silently
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Splits `s` into matches and the text between them (HF's Isolated behavior): every byte
  // lands in exactly one non-empty piece.
  void split_isolated(std::string_view s, std::vector<std::string_view>& out) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t pos = 0, last = 0;
    while (pos <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                                 PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(md);
        throw std::invalid_argument("tokenizer: regex matching failed with PCRE2 error " +
                                    std::to_string(rc));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t b = ov[0], e = ov[1];
      if (e == b) {  // an empty match: step over one character
        if (b >= s.size()) break;
        pos = b + std::max<size_t>(utf8_sequence(s, b), 1);
        continue;
      }
      if (b > last) out.push_back(s.substr(last, b - last));
      out.push_back(s.substr(b, e - b));
      last = pos = e;
    }
    if (last < s.size()) out.push_back(s.substr(last));
    pcre2_match_data_free(md);
  }

 private:
  pcre2_code* code_ = nullptr;
};

std::string escape_regex(const std::string& literal) {
  std::string out;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

struct AddedToken {
  int64_t id;
  std::string content;
  bool special, lstrip, rstrip;
};

}  // namespace

struct BpeTokenizer::Impl {
  std::string source;
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::string> id_to_token;  // model vocab and added tokens
  // (left id, right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> merges;
  bool ignore_merges = false;
  std::optional<int64_t> unk_id;
  std::vector<AddedToken> added;
  std::unordered_map<int64_t, size_t> added_by_id;
  std::vector<std::unique_ptr<Regex>> splits;  // Split pre-tokenizers, in order
  bool prefix_space = false;
  std::unique_ptr<Regex> byte_level_regex;                  // ByteLevel with use_regex
  std::vector<std::variant<int64_t, int>> template_single;  // a special id, or the sequence (0)

  std::string where() const { return "tokenizer '" + source + "'"; }
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(where() + ": " + what);
  }

  void parse(const json& j);
  void parse_model(const json& m);
  void parse_pre_tokenizer(const json& p, bool& byte_level_seen);
  void parse_post_processor(const json& p);
  void encode_piece(std::string_view text, std::vector<int64_t>& out) const;
  void bpe(const std::string& word, std::vector<int64_t>& out) const;
};

namespace {

std::string type_of(const json& j) {
  const auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string("?");
}

bool flag(const json& j, const char* key, bool fallback) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<bool>();
}

}  // namespace

void BpeTokenizer::Impl::parse_model(const json& m) {
  if (!m.is_object() || type_of(m) != "BPE") {
    fail("model type \"" + (m.is_object() ? type_of(m) : std::string("none")) +
         "\" is not supported; only byte-level \"BPE\" is");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto it = m.find(key);
    if (it != m.end() && !it->is_null() && !it->get<std::string>().empty())
      fail(std::string("model.") + key + " is not supported (byte-level BPE does not use it)");
  }
  if (flag(m, "byte_fallback", false)) fail("model.byte_fallback is not supported");
  const auto dropout = m.find("dropout");
  if (dropout != m.end() && !dropout->is_null() && dropout->get<double>() != 0.0)
    fail("model.dropout is not supported (encoding would not be deterministic)");
  ignore_merges = flag(m, "ignore_merges", false);

  const json& v = m.at("vocab");
  if (!v.is_object()) fail("model.vocab must be an object {token: id}");
  for (const auto& [token, id] : v.items()) {
    const int64_t i = id.get<int64_t>();
    if (i < 0) fail("model.vocab: token \"" + token + "\" has a negative id");
    vocab.emplace(token, i);
    if (static_cast<size_t>(i) >= id_to_token.size()) id_to_token.resize(i + 1);
    id_to_token[i] = token;
  }
  const auto id_of = [&](const std::string& t, size_t rank) {
    const auto it = vocab.find(t);
    if (it == vocab.end())
      fail("merge " + std::to_string(rank) + " uses \"" + t + "\", which is not in the vocab");
    return it->second;
  };
  const json& ms = m.at("merges");
  if (!ms.is_array()) fail("model.merges must be an array");
  for (size_t rank = 0; rank < ms.size(); ++rank) {
    const json& e = ms[rank];
    std::string a, b;
    if (e.is_string()) {  // "a b"
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        fail("merge " + std::to_string(rank) + " \"" + s + "\" is not two tokens \"a b\"");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      fail("merge " + std::to_string(rank) + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    const uint64_t key =
        (static_cast<uint64_t>(id_of(a, rank)) << 32) | static_cast<uint64_t>(id_of(b, rank));
    // The first (lowest-ranked) occurrence of a pair wins.
    merges.emplace(key, std::make_pair(static_cast<int64_t>(rank), id_of(a + b, rank)));
  }
  const auto unk = m.find("unk_token");
  if (unk != m.end() && !unk->is_null()) {
    const auto it = vocab.find(unk->get<std::string>());
    if (it != vocab.end()) unk_id = it->second;
  }
}

void BpeTokenizer::Impl::parse_pre_tokenizer(const json& p, bool& byte_level_seen) {
  const std::string type = type_of(p);
  if (type == "Sequence") {
    for (const auto& q : p.at("pretokenizers")) parse_pre_tokenizer(q, byte_level_seen);
    return;
  }
  if (byte_level_seen)
    fail("pre_tokenizer: \"" + type +
         "\" after ByteLevel is not supported (ByteLevel must come last)");
  if (type == "Split") {
    const std::string behavior = p.value("behavior", std::string("Isolated"));
    if (behavior != "Isolated")
      fail("pre_tokenizer Split: behavior \"" + behavior + "\" is not supported, only Isolated");
    if (flag(p, "invert", false)) fail("pre_tokenizer Split: invert is not supported");
    const json& pat = p.at("pattern");
    std::string regex;
    if (pat.contains("Regex")) {
      regex = pat.at("Regex").get<std::string>();
    } else if (pat.contains("String")) {
      regex = escape_regex(pat.at("String").get<std::string>());
    } else {
      fail("pre_tokenizer Split: pattern must be {\"Regex\": ...} or {\"String\": ...}");
    }
    splits.push_back(std::make_unique<Regex>(regex, where() + ", pre_tokenizer Split"));
  } else if (type == "ByteLevel") {
    byte_level_seen = true;
    prefix_space = flag(p, "add_prefix_space", false);
    if (flag(p, "use_regex", true))
      byte_level_regex = std::make_unique<Regex>(kGpt2Pattern, where() + ", ByteLevel");
  } else {
    fail("pre_tokenizer \"" + type + "\" is not supported; supported: Sequence, Split, ByteLevel");
  }
}

void BpeTokenizer::Impl::parse_post_processor(const json& p) {
  if (p.is_null()) return;
  const std::string type = type_of(p);
  if (type == "Sequence") {
    for (const auto& q : p.at("processors")) parse_post_processor(q);
  } else if (type == "ByteLevel") {
    // Adjusts offsets only; ids are unchanged.
  } else if (type == "TemplateProcessing") {
    const json& specials = p.at("special_tokens");
    for (const auto& piece : p.at("single")) {
      if (piece.contains("Sequence")) {
        template_single.emplace_back(0);
      } else if (piece.contains("SpecialToken")) {
        const std::string name = piece.at("SpecialToken").at("id").get<std::string>();
        if (!specials.contains(name))
          fail("post_processor: template token \"" + name + "\" is not in special_tokens");
        for (const auto& id : specials.at(name).at("ids"))
          template_single.emplace_back(id.get<int64_t>());
      } else {
        fail("post_processor: a template piece is neither Sequence nor SpecialToken");
      }
    }
  } else {
    fail("post_processor \"" + type +
         "\" is not supported; supported: TemplateProcessing, ByteLevel, Sequence");
  }
}

void BpeTokenizer::Impl::parse(const json& j) {
  if (!j.is_object()) fail("not a JSON object");
  parse_model(j.at("model"));
  const auto norm = j.find("normalizer");
  if (norm != j.end() && !norm->is_null())
    fail("normalizer \"" + type_of(*norm) + "\" is not supported (byte-level files have none)");
  bool byte_level = false;
  const auto pre = j.find("pre_tokenizer");
  if (pre != j.end() && !pre->is_null()) parse_pre_tokenizer(*pre, byte_level);
  if (!byte_level) fail("the pre_tokenizer has no ByteLevel step: not a byte-level BPE tokenizer");
  const auto dec = j.find("decoder");
  if (dec != j.end() && !dec->is_null() && type_of(*dec) != "ByteLevel")
    fail("decoder \"" + type_of(*dec) + "\" is not supported, only ByteLevel");
  const auto post = j.find("post_processor");
  if (post != j.end()) parse_post_processor(*post);

  const auto at = j.find("added_tokens");
  if (at != j.end() && at->is_array()) {
    for (const auto& t : *at) {
      AddedToken a{t.at("id").get<int64_t>(), t.at("content").get<std::string>(),
                   flag(t, "special", false), flag(t, "lstrip", false), flag(t, "rstrip", false)};
      if (a.id < 0 || a.content.empty()) fail("an added token has a negative id or no content");
      if (flag(t, "single_word", false))
        fail("added token \"" + a.content + "\": single_word is not supported");
      if (static_cast<size_t>(a.id) >= id_to_token.size()) id_to_token.resize(a.id + 1);
      id_to_token[a.id] = a.content;
      added_by_id[a.id] = added.size();
      added.push_back(std::move(a));
    }
  }
}

// Merges one pre-token (already in byte-level characters) by merge rank, lowest first and
// leftmost among equal ranks, as HF's BPE does.
void BpeTokenizer::Impl::bpe(const std::string& word, std::vector<int64_t>& out) const {
  if (ignore_merges) {
    const auto it = vocab.find(word);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<int64_t> syms;
  for (std::string_view c : utf8_chars(word)) {
    const auto it = vocab.find(std::string(c));
    if (it != vocab.end()) {
      syms.push_back(it->second);
    } else if (unk_id) {
      syms.push_back(*unk_id);  // HF drops characters outside the vocab without an unk token
    }
  }
  while (syms.size() > 1) {
    int64_t best_rank = std::numeric_limits<int64_t>::max(), best_id = -1;
    size_t best = 0;
    for (size_t i = 0; i + 1 < syms.size(); ++i) {
      const auto it =
          merges.find((static_cast<uint64_t>(syms[i]) << 32) | static_cast<uint64_t>(syms[i + 1]));
      if (it != merges.end() && it->second.first < best_rank) {
        best_rank = it->second.first;
        best_id = it->second.second;
        best = i;
      }
    }
    if (best_id < 0) break;
    syms[best] = best_id;
    syms.erase(syms.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  out.insert(out.end(), syms.begin(), syms.end());
}

// Text between added tokens: the Split regexes, then ByteLevel (prefix space, its own regex,
// bytes to characters), then BPE per pre-token.
void BpeTokenizer::Impl::encode_piece(std::string_view text, std::vector<int64_t>& out) const {
  std::vector<std::string_view> pieces{text}, next;
  for (const auto& re : splits) {
    next.clear();
    for (std::string_view p : pieces) re->split_isolated(p, next);
    pieces.swap(next);
  }
  const ByteMap& map = byte_map();
  std::string spaced, word;
  for (std::string_view p : pieces) {
    if (prefix_space && (p.empty() || p.front() != ' ')) {
      spaced = " ";
      spaced += p;
      p = spaced;
    }
    std::vector<std::string_view> words;
    if (byte_level_regex) {
      byte_level_regex->split_isolated(p, words);
    } else {
      words.push_back(p);
    }
    for (std::string_view w : words) {
      word.clear();
      for (char c : w) word += map.to_char[static_cast<unsigned char>(c)];
      bpe(word, out);
    }
  }
}

BpeTokenizer::BpeTokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

BpeTokenizer BpeTokenizer::from_json(std::string_view text, const std::string& source) {
  auto impl = std::make_shared<Impl>();
  impl->source = source;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    impl->fail(std::string("not valid JSON: ") + e.what());
  }
  try {
    impl->parse(j);
  } catch (const json::exception& e) {
    impl->fail(std::string("unexpected structure: ") + e.what());
  }
  return BpeTokenizer(std::move(impl));
}

BpeTokenizer BpeTokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("tokenizer '" + path + "': cannot open the file");
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str(), path);
}

std::vector<int64_t> BpeTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_sequence(text, i);
    if (n == 0)
      throw std::invalid_argument(t.where() + ": encode: the text is not valid UTF-8 at byte " +
                                  std::to_string(i));
    i += n;
  }
  std::vector<int64_t> ids;
  // Added tokens first: the leftmost match, the longest at that position; lstrip/rstrip
  // tokens take the whitespace beside them.
  size_t start = 0;
  while (start < text.size()) {
    size_t best_pos = std::string_view::npos;
    const AddedToken* best = nullptr;
    for (const auto& a : t.added) {
      const size_t pos = text.find(a.content, start);
      if (pos == std::string_view::npos) continue;
      if (pos < best_pos || (pos == best_pos && a.content.size() > best->content.size())) {
        best_pos = pos;
        best = &a;
      }
    }
    if (best == nullptr) break;
    size_t begin = best_pos, end = best_pos + best->content.size();
    if (best->lstrip) {
      while (begin > start && is_whitespace(static_cast<unsigned char>(text[begin - 1]))) --begin;
    }
    if (best->rstrip) {
      while (end < text.size() && is_whitespace(static_cast<unsigned char>(text[end]))) ++end;
    }
    if (begin > start) t.encode_piece(text.substr(start, begin - start), ids);
    ids.push_back(best->id);
    start = end;
  }
  if (start < text.size()) t.encode_piece(text.substr(start), ids);
  if (!add_special_tokens || t.template_single.empty()) return ids;
  std::vector<int64_t> out;
  for (const auto& piece : t.template_single) {
    if (const auto* id = std::get_if<int64_t>(&piece)) {
      out.push_back(*id);
    } else {
      out.insert(out.end(), ids.begin(), ids.end());
    }
  }
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const ByteMap& map = byte_map();
  std::string bytes;
  for (int64_t id : ids) {
    const std::string token = id_to_token(id);
    if (skip_special_tokens && is_special(id)) continue;
    // A token all of whose characters are byte-level ones stands for those bytes; any other
    // (an added token such as "<|eot_id|>" is all ASCII, so it maps too) for its own UTF-8.
    std::string decoded;
    bool mapped = true;
    for (std::string_view c : utf8_chars(token)) {
      const auto it = map.to_byte.find(decode_one(c));
      if (it == map.to_byte.end()) {
        mapped = false;
        break;
      }
      decoded += static_cast<char>(it->second);
    }
    bytes += mapped ? decoded : token;
  }
  return utf8_lossy(bytes);
}

int64_t BpeTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

std::optional<int64_t> BpeTokenizer::token_to_id(std::string_view token) const {
  for (const auto& a : impl_->added) {
    if (a.content == token) return a.id;
  }
  const auto it = impl_->vocab.find(std::string(token));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::string BpeTokenizer::id_to_token(int64_t id) const {
  const auto& v = impl_->id_to_token;
  if (id < 0 || static_cast<size_t>(id) >= v.size() || v[id].empty()) {
    throw std::out_of_range(impl_->where() + ": token id " + std::to_string(id) +
                            " is not in the vocabulary (ids 0.." + std::to_string(v.size() - 1) +
                            ")");
  }
  return v[id];
}

bool BpeTokenizer::is_special(int64_t id) const {
  const auto a = impl_->added_by_id.find(id);
  return a != impl_->added_by_id.end() && impl_->added[a->second].special;
}

}  // namespace dtensor::text
