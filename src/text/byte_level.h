#pragma once
// GPT-2's byte-level alphabet: each byte as a printable character (printable Latin-1 bytes as
// themselves, the others as U+0100 onwards in byte order), used by the ByteLevel pre-tokenizer
// and decoder.
#include <optional>
#include <string>
#include <string_view>

namespace dtensor::text {

/// Each byte of `bytes` as its byte-level character.
std::string bytes_to_byte_level(std::string_view bytes);

/// The bytes a token of byte-level characters stands for; nullopt if one character is not one.
std::optional<std::string> byte_level_to_bytes(std::string_view token);

}  // namespace dtensor::text
