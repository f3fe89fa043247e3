#include "tokenizer.h"

#include <stdexcept>

namespace dtensor::train {

std::vector<int64_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& tokens) const {
  std::string text;
  text.reserve(tokens.size());
  for (int64_t id : tokens) {
    if (id < 0 || id >= kVocabSize) {
      throw std::out_of_range("ByteTokenizer::decode: token id " + std::to_string(id) +
                              " is outside the byte vocabulary [0, 256)");
    }
    text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
  }
  return text;
}

}  // namespace dtensor::train
