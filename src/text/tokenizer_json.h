#pragma once
// Reading the components of a Hugging Face tokenizer.json: a JsonKey is where a value sits in
// the file, so that every error names the file, the key and the value, e.g.
//   tokenizer 'gemma/tokenizer.json': normalizer.normalizers[1].type "Precompiled" is not
//   supported; supported: NFC, NFD, NFKC, NFKD, Lowercase, Strip, Replace, Prepend, Sequence
#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace dtensor::text {

class JsonKey {
 public:
  JsonKey(std::string source, std::string key) : source_(std::move(source)), key_(std::move(key)) {}
  JsonKey operator[](std::string_view child) const;
  JsonKey operator[](size_t index) const;

  /// "tokenizer 'FILE'"
  std::string where() const { return "tokenizer '" + source_ + "'"; }
  const std::string& key() const { return key_; }
  /// Throws std::invalid_argument "tokenizer 'FILE': KEY WHAT".
  [[noreturn]] void fail(const std::string& what) const;
  /// Throws "tokenizer 'FILE': KEY VALUE is not supported; supported: SUPPORTED".
  [[noreturn]] void unsupported(const nlohmann::json& value, std::string_view supported) const;

 private:
  std::string source_, key_;
};

/// j["type"] as a string, or "?" when it is missing.
std::string type_of(const nlohmann::json& j);

/// A boolean member, `fallback` when it is missing or null.
bool flag(const nlohmann::json& j, const char* key, bool fallback);

/// A string member; fails naming the key when it is missing or not a string.
std::string string_at(const nlohmann::json& j, const char* key, const JsonKey& at);

/// An HF pattern {"String": literal} or {"Regex": pattern} as a PCRE2 pattern.
std::string pattern_of(const nlohmann::json& pattern, const JsonKey& at);

}  // namespace dtensor::text
