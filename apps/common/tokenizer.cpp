#include "tokenizer.h"

#include <filesystem>
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

TextTokenizer TextTokenizer::from_hf_file(const std::string& path) {
  if (!std::filesystem::is_regular_file(path)) {
    throw std::invalid_argument("no tokenizer file '" + path +
                                "': --hf fine-tunes on text tokenized with the checkpoint's own "
                                "tokenizer.json");
  }
  TextTokenizer t;
  t.bpe_ = std::make_shared<const text::BpeTokenizer>(text::BpeTokenizer::from_file(path));
  t.path_ = path;
  return t;
}

std::vector<int64_t> TextTokenizer::encode(std::string_view text) const {
  return bpe_ ? bpe_->encode(text, /*add_special_tokens=*/true) : bytes_.encode(text);
}

std::string TextTokenizer::decode(const std::vector<int64_t>& tokens) const {
  return bpe_ ? bpe_->decode(tokens, /*skip_special_tokens=*/true) : bytes_.decode(tokens);
}

int64_t TextTokenizer::vocab_size() const {
  return bpe_ ? bpe_->vocab_size() : bytes_.vocab_size();
}

std::string TextTokenizer::describe() const { return bpe_ ? path_ : "bytes"; }

}  // namespace dtensor::train
