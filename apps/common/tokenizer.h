#pragma once
// Tokenizers of dtensor_train: bytes (every byte one token, vocabulary 256), so that any text
// file can be trained on without a learned vocabulary, or a Hugging Face checkpoint's own
// tokenizer.json when fine-tuning it (--hf).
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/text/bpe_tokenizer.h"

namespace dtensor::train {

// decode(encode(s)) == s for every string.
class ByteTokenizer {
 public:
  static constexpr int64_t kVocabSize = 256;

  int64_t vocab_size() const { return kVocabSize; }
  std::vector<int64_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int64_t>& tokens) const;  // ids outside [0,256) throw
};

// The run's tokenizer: bytes, or the BPE tokenizer of a tokenizer.json.
class TextTokenizer {
 public:
  TextTokenizer() = default;  // bytes
  // Throws naming the file when it is missing or not a tokenizer this library reads.
  static TextTokenizer from_hf_file(const std::string& path);

  // Text as HF's tokenizer(text) gives it: with the post-processor's template (Llama 3's BOS).
  std::vector<int64_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int64_t>& tokens) const;
  // Ids decode() knows: [0, vocab_size()).
  int64_t vocab_size() const;
  // "bytes" or the tokenizer.json path.
  std::string describe() const;

 private:
  ByteTokenizer bytes_;
  std::shared_ptr<const text::BpeTokenizer> bpe_;
  std::string path_;
};

}  // namespace dtensor::train
