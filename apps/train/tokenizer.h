#pragma once
// Byte-level tokenizer: every byte is one token (vocabulary 256), so any text file can be
// trained on without a learned vocabulary, and decode(encode(s)) == s for every string.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor::train {

class ByteTokenizer {
 public:
  static constexpr int64_t kVocabSize = 256;

  int64_t vocab_size() const { return kVocabSize; }
  std::vector<int64_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int64_t>& tokens) const;  // ids outside [0,256) throw
};

}  // namespace dtensor::train
