#pragma once
// The normalizer of a tokenizer.json, as HF `tokenizers` defines each kind: NFC, NFD, NFKC,
// NFKD (unicode_normalize.h), Lowercase, Strip, Replace, Prepend and Sequence.
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "tokenizer_json.h"

namespace dtensor::text {

using Normalizer = std::function<std::string(std::string_view)>;

/// The normalizer `j` describes (read at `at`, e.g. "normalizer"); an empty function for null.
/// An unsupported kind fails naming the file, the key and the value.
Normalizer make_normalizer(const nlohmann::json& j, const JsonKey& at);

}  // namespace dtensor::text
