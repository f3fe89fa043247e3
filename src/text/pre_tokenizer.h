#pragma once
// The pre-tokenizer of a tokenizer.json, as HF `tokenizers` defines each kind: Split (every
// delimiter behavior, invert), ByteLevel, Metaspace and Sequence. It cuts the normalized text
// into the words the model encodes one by one.
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer_json.h"

namespace dtensor::text {

struct PreToken {
  std::string text;
  bool at_start;  // begins at offset 0 of the original text (Metaspace's prepend_scheme "first")
};

/// Rewrites the list in place; pieces that become empty are dropped, as HF drops them.
using PreTokenizer = std::function<void(std::vector<PreToken>&)>;

/// The pre-tokenizer `j` describes (read at `at`); an empty function for null. An unsupported
/// kind or option fails naming the file, the key and the value.
PreTokenizer make_pre_tokenizer(const nlohmann::json& j, const JsonKey& at);

}  // namespace dtensor::text
