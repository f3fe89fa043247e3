#pragma once
// A BPE tokenizer read from a Hugging Face `tokenizer.json`, encoding and decoding as HF
// `tokenizers` does, for the files Llama 3, GPT-2, Qwen2/Qwen3 (byte-level BPE with an NFC
// normalizer), Gemma and Llama-2/Mistral (SentencePiece-style BPE with byte_fallback) ship:
//
//   auto tok = dtensor::text::BpeTokenizer::from_file("Qwen3-0.6B/tokenizer.json");
//   std::vector<int64_t> ids = tok.encode("Hello world", /*add_special_tokens=*/true);
//   std::string text = tok.decode(ids, /*skip_special_tokens=*/true);
//
// Supported: normalizers NFC/NFD/NFKC/NFKD, Lowercase, Strip, Replace, Prepend, Sequence;
// pre-tokenizers Split (every behavior), ByteLevel, Metaspace, Sequence; model "BPE" (merges as
// "a b" strings or [a, b] pairs, ignore_merges, byte_fallback, unk_token, fuse_unk); decoders
// ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence; post-processors
// TemplateProcessing (single sequences), ByteLevel, Sequence; added tokens (split out of the raw
// or the normalized text as their `normalized` flag says, lstrip/rstrip). Anything else is
// refused when the file is read, naming the file, the JSON key and its value (docs/ARCHITECTURE.md,
// "Tokenizers (layer `text`)"). Regexes run with PCRE2 in Unicode mode, normalization forms with
// utf8proc. Independent of LibTorch. Errors throw std::invalid_argument (bad file, unsupported
// component, text that is not UTF-8) or std::out_of_range (bad id).
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
