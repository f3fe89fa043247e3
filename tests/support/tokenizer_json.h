#pragma once
// Small tokenizer.json files for the text tests: a BPE model whose vocabulary is given words
// (and every character in them) with no merges and ignore_merges, so a word found whole is one
// token and the tokens show what the normalizer and pre-tokenizer made of the text.
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/text/bpe_tokenizer.h"

namespace dtensor::testing {

// SentencePiece's word-boundary mark "▁" (U+2581), which Metaspace pre-tokenizers and decoders use.
inline const std::string kMeta = "\xE2\x96\x81";

inline nlohmann::json word_tokenizer_json(const std::vector<std::string>& words) {
  nlohmann::json vocab = nlohmann::json::object();
  const auto add = [&](const std::string& t) {
    if (!vocab.contains(t)) vocab[t] = vocab.size();
  };
  for (const auto& w : words) {
    for (size_t i = 0; i < w.size();) {  // each UTF-8 character
      size_t n = 1;
      while (i + n < w.size() && (static_cast<unsigned char>(w[i + n]) & 0xC0) == 0x80) ++n;
      add(w.substr(i, n));
      i += n;
    }
    add(w);
  }
  return {{"model",
           {{"type", "BPE"},
            {"vocab", vocab},
            {"merges", nlohmann::json::array()},
            {"ignore_merges", true}}}};
}

/// The tokens `tok` encodes `text` into.
inline std::vector<std::string> tokens_of(const text::BpeTokenizer& tok, std::string_view text) {
  std::vector<std::string> out;
  for (int64_t id : tok.encode(text)) out.push_back(tok.id_to_token(id));
  return out;
}

}  // namespace dtensor::testing
