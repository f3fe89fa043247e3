// BPE as HF `tokenizers` runs it: added tokens are split out of the raw text first, the rest is
// normalized (and split again on added tokens that match normalized text), pre-tokenized into
// words, and each word is merged by merge rank, with SentencePiece's byte fallback; the
// post-processor's template adds special tokens. Decoding maps ids to tokens and runs the
// decoder chain.
#include "dtensor/text/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <variant>

#include "decoder.h"
#include "normalizer.h"
#include "pre_tokenizer.h"
#include "tokenizer_json.h"
#include "utf8.h"

namespace dtensor::text {

namespace {

using nlohmann::json;

struct AddedToken {
  int64_t id;
  std::string content;
  bool special, lstrip, rstrip, normalized;
  std::string match;  // what is searched for: the content, normalized if `normalized`
};

// The added tokens as a byte trie, for the leftmost-longest match HF's Aho-Corasick finds:
// a text is scanned once, not once per token (Gemma 3 has thousands).
class TokenTrie {
 public:
  void insert(const std::string& s, size_t token) {
    size_t node = 0;
    for (char c : s) {
      const uint64_t k = key(node, c);
      auto it = edges_.find(k);
      if (it == edges_.end()) {
        it = edges_.emplace(k, ends_.size()).first;
        ends_.push_back(kNone);
      }
      node = it->second;
    }
    if (ends_[node] == kNone) ends_[node] = token;  // the first of equal contents wins
  }
  /// The longest token that starts at text[pos], as (token, length); token kNone if none.
  std::pair<size_t, size_t> longest_at(std::string_view text, size_t pos) const {
    std::pair<size_t, size_t> best{kNone, 0};
    size_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      const auto it = edges_.find(key(node, text[i]));
      if (it == edges_.end()) break;
      node = it->second;
      if (ends_[node] != kNone) best = {ends_[node], i + 1 - pos};
    }
    return best;
  }
  bool empty() const { return edges_.empty(); }
  static constexpr size_t kNone = std::numeric_limits<size_t>::max();

 private:
  static uint64_t key(size_t node, char c) {
    return (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(c);
  }
  std::unordered_map<uint64_t, size_t> edges_;
  std::vector<size_t> ends_{kNone};  // node -> token index; node 0 is the root
};

// A piece of text between added tokens, or an added token; `offset` is where it starts.
struct Segment {
  std::string_view text;
  size_t offset;
  const AddedToken* token;
};

// The start of the character before s[i] (s is valid UTF-8, i > 0).
size_t previous_char(std::string_view s, size_t i) {
  do {
    --i;
  } while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80);
  return i;
}

bool whitespace_at(std::string_view s, size_t i) {
  const size_t n = std::max<size_t>(utf8_sequence(s, i), 1);
  return is_whitespace(code_point(s.substr(i, n)));
}

}  // namespace

struct BpeTokenizer::Impl {
  std::string source;
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::string> id_to_token;  // model vocab and added tokens
  // (left id, right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> merges;
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  std::optional<std::string> unk_token;
  std::array<int64_t, 256> byte_ids{};  // the id of "<0xAB>", -1 if absent
  std::vector<AddedToken> added;
  std::unordered_map<int64_t, size_t> added_by_id;
  TokenTrie raw_added, normalized_added;  // by what they match: raw or normalized text
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  Decoder decoder;
  std::vector<std::variant<int64_t, int>> template_single;  // a special id, or the sequence (0)

  JsonKey key(const std::string& k) const { return JsonKey(source, k); }
  std::string where() const { return "tokenizer '" + source + "'"; }
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(where() + ": " + what);
  }

  void parse(const json& j);
  void parse_model(const json& m);
  void parse_added_tokens(const json& a);
  void parse_post_processor(const json& p, const JsonKey& at);
  void split_added(std::string_view text, size_t offset, bool normalized,
                   std::vector<Segment>& out) const;
  void encode_text(std::string_view text, bool at_start, std::vector<int64_t>& out) const;
  void bpe(const std::string& word, std::vector<int64_t>& out) const;
  void merge_all(const std::vector<int64_t>& syms, std::vector<int64_t>& out) const;
};

void BpeTokenizer::Impl::parse_model(const json& m) {
  const JsonKey at = key("model");
  if (!m.is_object()) at.fail("must be an object");
  if (type_of(m) != "BPE") at["type"].unsupported(m.value("type", json("?")), "BPE");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto it = m.find(k);
    if (it != m.end() && !it->is_null() && !it->get<std::string>().empty())
      at[k].unsupported(*it, "\"\" or null (the decoders built here do not remove it)");
  }
  const auto dropout = m.find("dropout");
  if (dropout != m.end() && !dropout->is_null() && dropout->get<double>() != 0.0)
    at["dropout"].unsupported(*dropout, "null or 0 (encoding must be deterministic)");
  ignore_merges = flag(m, "ignore_merges", false);
  byte_fallback = flag(m, "byte_fallback", false);
  fuse_unk = flag(m, "fuse_unk", false);

  const auto v = m.find("vocab");
  if (v == m.end() || !v->is_object()) at["vocab"].fail("must be an object {token: id}");
  for (const auto& [token, id] : v->items()) {
    const int64_t i = id.get<int64_t>();
    if (i < 0) at["vocab"].fail("gives token \"" + token + "\" a negative id");
    vocab.emplace(token, i);
    if (static_cast<size_t>(i) >= id_to_token.size()) id_to_token.resize(i + 1);
    id_to_token[i] = token;
  }
  byte_ids.fill(-1);
  for (int b = 0; b < 256; ++b) {
    static const char* hex = "0123456789ABCDEF";
    const std::string name = std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
    const auto it = vocab.find(name);
    if (it != vocab.end()) byte_ids[b] = it->second;
  }
  const auto id_of = [&](const std::string& t, size_t rank) {
    const auto it = vocab.find(t);
    if (it == vocab.end()) at["merges"][rank].fail("uses \"" + t + "\", which is not in the vocab");
    return it->second;
  };
  const auto ms = m.find("merges");
  if (ms == m.end() || !ms->is_array()) at["merges"].fail("must be an array");
  for (size_t rank = 0; rank < ms->size(); ++rank) {
    const json& e = (*ms)[rank];
    std::string a, b;
    if (e.is_string()) {  // "a b"
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        at["merges"][rank].fail("\"" + s + "\" is not two tokens \"a b\"");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      at["merges"][rank].fail("is neither \"a b\" nor [\"a\", \"b\"]");
    }
    const uint64_t k =
        (static_cast<uint64_t>(id_of(a, rank)) << 32) | static_cast<uint64_t>(id_of(b, rank));
    // The first (lowest-ranked) occurrence of a pair wins.
    merges.emplace(k, std::make_pair(static_cast<int64_t>(rank), id_of(a + b, rank)));
  }
  const auto unk = m.find("unk_token");
  if (unk != m.end() && !unk->is_null()) unk_token = unk->get<std::string>();
}

void BpeTokenizer::Impl::parse_post_processor(const json& p, const JsonKey& at) {
  if (p.is_null()) return;
  const std::string type = type_of(p);
  if (type == "Sequence") {
    const auto& ps = p.at("processors");
    for (size_t i = 0; i < ps.size(); ++i) parse_post_processor(ps[i], at["processors"][i]);
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
          at["single"].fail("uses \"" + name + "\", which is not in special_tokens");
        for (const auto& id : specials.at(name).at("ids"))
          template_single.emplace_back(id.get<int64_t>());
      } else {
        at["single"].fail("has a piece that is neither Sequence nor SpecialToken");
      }
    }
  } else {
    at["type"].unsupported(p.value("type", json("?")), "TemplateProcessing, ByteLevel, Sequence");
  }
}

void BpeTokenizer::Impl::parse_added_tokens(const json& a) {
  if (!a.is_array()) return;
  for (size_t i = 0; i < a.size(); ++i) {
    const json& t = a[i];
    const JsonKey at = key("added_tokens")[i];
    AddedToken tok{t.at("id").get<int64_t>(),
                   t.at("content").get<std::string>(),
                   flag(t, "special", false),
                   flag(t, "lstrip", false),
                   flag(t, "rstrip", false),
                   false,
                   {}};
    // HF's default: special tokens match the raw text, others the normalized text.
    tok.normalized = flag(t, "normalized", !tok.special);
    if (tok.id < 0 || tok.content.empty()) at.fail("has a negative id or no content");
    if (flag(t, "single_word", false)) at["single_word"].unsupported(t.at("single_word"), "false");
    tok.match = tok.normalized && normalizer ? normalizer(tok.content) : tok.content;
    if (!tok.match.empty())
      (tok.normalized ? normalized_added : raw_added).insert(tok.match, added.size());
    if (static_cast<size_t>(tok.id) >= id_to_token.size()) id_to_token.resize(tok.id + 1);
    // HF's id_to_token gives a normalized token's normalized form.
    id_to_token[tok.id] = tok.match;
    added_by_id[tok.id] = added.size();
    added.push_back(std::move(tok));
  }
}

void BpeTokenizer::Impl::parse(const json& j) {
  if (!j.is_object()) fail("not a JSON object");
  const auto component = [&](const char* k) {
    const auto it = j.find(k);
    return it == j.end() ? json() : *it;
  };
  parse_model(j.at("model"));
  normalizer = make_normalizer(component("normalizer"), key("normalizer"));
  pre_tokenizer = make_pre_tokenizer(component("pre_tokenizer"), key("pre_tokenizer"));
  decoder = make_decoder(component("decoder"), key("decoder"));
  parse_post_processor(component("post_processor"), key("post_processor"));
  parse_added_tokens(component("added_tokens"));
}

// Added tokens (those matching raw or normalized text, as `normalized` says): the leftmost
// match, the longest at that position; lstrip/rstrip tokens take the whitespace beside them.
void BpeTokenizer::Impl::split_added(std::string_view text, size_t offset, bool normalized,
                                     std::vector<Segment>& out) const {
  const TokenTrie& trie = normalized ? normalized_added : raw_added;
  size_t start = 0;
  for (size_t pos = 0; pos < text.size(); ++pos) {
    const auto [index, length] = trie.longest_at(text, pos);
    if (index == TokenTrie::kNone) continue;
    const AddedToken* best = &added[index];
    size_t begin = pos, end = pos + length;
    if (best->lstrip) {
      while (begin > start && whitespace_at(text, previous_char(text, begin)))
        begin = previous_char(text, begin);
    }
    if (best->rstrip) {
      while (end < text.size() && whitespace_at(text, end))
        end += std::max<size_t>(utf8_sequence(text, end), 1);
    }
    if (begin > start) out.push_back({text.substr(start, begin - start), offset + start, nullptr});
    out.push_back({{}, offset + begin, best});
    start = end;
    pos = end - 1;
  }
  if (start < text.size()) out.push_back({text.substr(start), offset + start, nullptr});
}

// Text between raw-matched added tokens: normalize, split out normalized added tokens,
// pre-tokenize, BPE each word.
void BpeTokenizer::Impl::encode_text(std::string_view text, bool at_start,
                                     std::vector<int64_t>& out) const {
  const std::string normalized = normalizer ? normalizer(text) : std::string(text);
  std::vector<Segment> segments;
  if (!normalized_added.empty()) {
    split_added(normalized, 0, true, segments);
  } else {
    segments.push_back({normalized, 0, nullptr});
  }
  for (const Segment& s : segments) {
    if (s.token != nullptr) {
      out.push_back(s.token->id);
      continue;
    }
    if (s.text.empty()) continue;
    std::vector<PreToken> words{{std::string(s.text), at_start && s.offset == 0}};
    if (pre_tokenizer) pre_tokenizer(words);
    for (const PreToken& w : words) bpe(w.text, out);
  }
}

// HF's BPE::merge_word: characters to ids (a character outside the vocab becomes its
// <0xAB> byte tokens with byte_fallback, else the unk token, runs of unknowns fused into one
// with fuse_unk), then merges by rank, lowest first and leftmost among equals.
void BpeTokenizer::Impl::bpe(const std::string& word, std::vector<int64_t>& out) const {
  if (ignore_merges) {
    const auto it = vocab.find(word);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<int64_t> syms;
  bool unk_pending = false;
  int64_t unk_id = -1;
  const auto unk = [&] {
    if (unk_id >= 0) return unk_id;
    const auto it = vocab.find(*unk_token);
    if (it == vocab.end())
      fail("model.unk_token \"" + *unk_token + "\" is needed but is not in model.vocab");
    return unk_id = it->second;
  };
  for (std::string_view c : utf8_chars(word)) {
    const auto it = vocab.find(std::string(c));
    if (it != vocab.end()) {
      if (unk_pending) syms.push_back(unk());
      unk_pending = false;
      syms.push_back(it->second);
      continue;
    }
    if (byte_fallback && std::all_of(c.begin(), c.end(), [&](char b) {
          return byte_ids[static_cast<unsigned char>(b)] >= 0;
        })) {
      // As in HF, an unknown character still pending is placed after these bytes.
      for (char b : c) syms.push_back(byte_ids[static_cast<unsigned char>(b)]);
      continue;
    }
    if (!unk_token) continue;  // HF drops characters outside the vocab without an unk token
    if (unk_pending && !fuse_unk) syms.push_back(unk());
    unk_pending = true;
  }
  if (unk_pending) syms.push_back(unk());
  merge_all(syms, out);
}

// Merges `syms` by rank as HF's Word::merge_all does: a heap of candidate pairs, lowest rank
// first and leftmost among equals; a popped pair whose symbols have since changed is stale and
// skipped. O(n log n), because a SentencePiece-style file with no pre-tokenizer (Llama 2) or
// one that splits nothing (Gemma) hands the model a whole text as one word.
void BpeTokenizer::Impl::merge_all(const std::vector<int64_t>& syms,
                                   std::vector<int64_t>& out) const {
  const size_t n = syms.size();
  std::vector<int64_t> id(syms);
  std::vector<size_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  constexpr size_t kNone = std::numeric_limits<size_t>::max();
  for (size_t i = 0; i < n; ++i) {
    prev[i] = i == 0 ? kNone : i - 1;
    next[i] = i + 1 < n ? i + 1 : kNone;
  }
  struct Candidate {
    int64_t rank;
    size_t pos;
    int64_t merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  const auto merge_of = [&](size_t left) -> const std::pair<int64_t, int64_t>* {
    const auto it = merges.find((static_cast<uint64_t>(id[left]) << 32) |
                                static_cast<uint64_t>(id[next[left]]));
    return it == merges.end() ? nullptr : &it->second;
  };
  const auto push = [&](size_t left) {
    if (left == kNone || next[left] == kNone) return;
    if (const auto* m = merge_of(left)) heap.push({m->first, left, m->second});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.pos] || next[c.pos] == kNone) continue;
    const auto* m = merge_of(c.pos);
    if (m == nullptr || m->second != c.merged) continue;  // stale
    const size_t right = next[c.pos];
    id[c.pos] = c.merged;
    alive[right] = false;
    next[c.pos] = next[right];
    if (next[right] != kNone) prev[next[right]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  for (size_t i = 0; i < n; ++i)
    if (alive[i]) out.push_back(id[i]);
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
  const size_t bad = utf8_invalid_at(text);
  if (bad != std::string_view::npos)
    t.fail("encode: the text is not valid UTF-8 at byte " + std::to_string(bad));
  std::vector<Segment> segments;
  if (!t.raw_added.empty()) {
    t.split_added(text, 0, false, segments);
  } else if (!text.empty()) {
    segments.push_back({text, 0, nullptr});
  }
  std::vector<int64_t> ids;
  for (const Segment& s : segments) {
    if (s.token != nullptr) {
      ids.push_back(s.token->id);
    } else {
      t.encode_text(s.text, s.offset == 0, ids);
    }
  }
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
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    std::string token = id_to_token(id);
    if (!(skip_special_tokens && is_special(id))) tokens.push_back(std::move(token));
  }
  std::string out;
  if (!impl_->decoder) {  // HF joins the tokens with spaces when there is no decoder
    for (size_t i = 0; i < tokens.size(); ++i) out += (i > 0 ? " " : "") + tokens[i];
    return out;
  }
  for (const std::string& piece : impl_->decoder(std::move(tokens))) out += piece;
  return out;
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
