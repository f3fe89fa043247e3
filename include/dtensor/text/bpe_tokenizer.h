#pragma once
// A byte-level BPE tokenizer read from a Hugging Face `tokenizer.json`, encoding and decoding as
// HF `tokenizers` does, for the files Llama 3 and GPT-2 style models ship:
//
//   auto tok = dtensor::text::BpeTokenizer::from_file("Llama-3.2-1B/tokenizer.json");
//   std::vector<int64_t> ids = tok.encode("Hello world", /*add_special_tokens=*/true);
//   std::string text = tok.decode(ids, /*skip_special_tokens=*/true);
//
// Supported: model "BPE" (vocab; merges as "a b" strings or [a, b] pairs; ignore_merges;
// unk_token), added tokens (split out of the text before anything else, lstrip/rstrip), no
// normalizer, pre-tokenizers "Split" (a regex or string, behavior Isolated) followed by
// "ByteLevel" (add_prefix_space, use_regex with GPT-2's pattern), post-processors
// "TemplateProcessing" (single sequences) and "ByteLevel", decoder "ByteLevel". Anything else is
// refused when the file is read, naming the file and the component. Regexes run with PCRE2 in
// Unicode mode (\p{L}, \p{N}, \s as Unicode classes). Independent of LibTorch. Errors throw
// std::invalid_argument (bad file or unsupported component) or std::out_of_range (bad id).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor::text {

class BpeTokenizer {
 public:
  /// `source` names the file in error messages.
  static BpeTokenizer from_file(const std::string& path);
  static BpeTokenizer from_json(std::string_view json, const std::string& source = "<json>");

  /// `text` must be valid UTF-8. add_special_tokens applies the post-processor's template
  /// (Llama 3: a leading <|begin_of_text|>); HF's add_special_tokens=True.
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = false) const;
  /// Bytes that do not form UTF-8 (a sequence cut inside a character) become U+FFFD, as in HF.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  /// Model vocabulary and added tokens (HF's get_vocab_size(with_added_tokens=True)).
  int64_t vocab_size() const;
  std::optional<int64_t> token_to_id(std::string_view token) const;
  std::string id_to_token(int64_t id) const;  // throws std::out_of_range
  bool is_special(int64_t id) const;

 private:
  struct Impl;
  explicit BpeTokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace dtensor::text
