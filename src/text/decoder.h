#pragma once
// The decoder of a tokenizer.json, as HF `tokenizers` defines each kind: ByteLevel, Replace,
// ByteFallback, Fuse, Strip, Metaspace and Sequence. Each maps the list of token strings to a new
// list (HF's decode_chain); the decoded text is the result joined.
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer_json.h"

namespace dtensor::text {

using Decoder = std::function<std::vector<std::string>(std::vector<std::string>)>;

/// The decoder `j` describes (read at `at`); an empty function for null. An unsupported kind
/// fails naming the file, the key and the value.
Decoder make_decoder(const nlohmann::json& j, const JsonKey& at);

}  // namespace dtensor::text
