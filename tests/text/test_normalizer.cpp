// The normalizers of tokenizer.json (src/text/normalizer.cpp) as HF `tokenizers` applies them,
// seen through the tokens of a word-level vocabulary; the expected strings are HF's
// (normalizers.X().normalize_str) and Unicode's own normalization forms. Each unsupported kind is
// refused naming the file, the key and the value.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtensor/text/bpe_tokenizer.h"
#include "support/errors.h"
#include "support/tokenizer_json.h"

using dtensor::testing::message_of;
using dtensor::testing::tokens_of;
using dtensor::testing::word_tokenizer_json;
using dtensor::text::BpeTokenizer;
using nlohmann::json;
using Tokens = std::vector<std::string>;

namespace {

BpeTokenizer with_normalizer(const json& normalizer, const std::vector<std::string>& words) {
  json j = word_tokenizer_json(words);
  j["normalizer"] = normalizer;
  return BpeTokenizer::from_json(j.dump(), "normalizer-test.json");
}

const std::string kEAcute = "\xC3\xA9";          // é, precomposed
const std::string kECombining = "e\xCC\x81";     // e + U+0301
const std::string kFiLigature = "\xEF\xAC\x81";  // ﬁ
const std::string kDottedCapitalI = "\xC4\xB0";  // İ
const std::string kCombiningDot = "\xCC\x87";    // U+0307

TEST(Normalizer, UnicodeFormsComposeAndDecompose) {
  const std::vector<std::string> words{kEAcute, kECombining, "fi" + kEAcute, "fi" + kECombining,
                                       kFiLigature};
  EXPECT_EQ(tokens_of(with_normalizer({{"type", "NFC"}}, words), kECombining), Tokens{kEAcute});
  EXPECT_EQ(tokens_of(with_normalizer({{"type", "NFD"}}, words), kEAcute), Tokens{kECombining});
  // The compatibility forms also unfold the ligature; the canonical ones keep it.
  EXPECT_EQ(tokens_of(with_normalizer({{"type", "NFKC"}}, words), kFiLigature + kECombining),
            Tokens{"fi" + kEAcute});
  EXPECT_EQ(tokens_of(with_normalizer({{"type", "NFKD"}}, words), kFiLigature + kEAcute),
            Tokens{"fi" + kECombining});
  EXPECT_EQ(tokens_of(with_normalizer({{"type", "NFC"}}, words), kFiLigature), Tokens{kFiLigature});
}

TEST(Normalizer, LowercaseIsRustsFullMappingPerCharacter) {
  // İ lowercases to "i" + U+0307 (SpecialCasing); Σ to σ everywhere (no final-sigma rule).
  const auto tok = with_normalizer({{"type", "Lowercase"}},
                                   {"i" + kCombiningDot + "stanbul", "\xCF\x83\xCE\xB1\xCF\x83"});
  EXPECT_EQ(tokens_of(tok, kDottedCapitalI + "STANBUL"), Tokens{"i" + kCombiningDot + "stanbul"});
  EXPECT_EQ(tokens_of(tok, "\xCE\xA3\xCE\x91\xCE\xA3"), Tokens{"\xCF\x83\xCE\xB1\xCF\x83"});
}

TEST(Normalizer, StripReplacePrependAndSequenceInOrder) {
  const std::string ideographic_space = "\xE3\x80\x80";  // Unicode whitespace
  EXPECT_EQ(
      tokens_of(with_normalizer({{"type", "Strip"}, {"strip_left", false}, {"strip_right", true}},
                                {ideographic_space + " a"}),
                ideographic_space + " a \t"),
      Tokens{ideographic_space + " a"});
  EXPECT_EQ(tokens_of(with_normalizer(
                          {{"type", "Replace"}, {"pattern", {{"Regex", "\\s+"}}}, {"content", "_"}},
                          {"a_b_c"}),
                      "a  b\tc"),
            Tokens{"a_b_c"});
  const std::string meta = "\xE2\x96\x81";  // ▁
  const json prepend = {{"type", "Prepend"}, {"prepend", meta}};
  const json replace = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", meta}};
  const std::vector<std::string> words{meta + "a" + meta + "b"};
  // Llama-2's order: prepend, then spaces to ▁; a string literal is not a regex ("." below).
  EXPECT_EQ(
      tokens_of(with_normalizer({{"type", "Sequence"}, {"normalizers", {prepend, replace}}}, words),
                "a b"),
      Tokens{meta + "a" + meta + "b"});
  EXPECT_EQ(tokens_of(with_normalizer(
                          {{"type", "Replace"}, {"pattern", {{"String", "."}}}, {"content", "b"}},
                          {"ab"}),
                      "a."),
            Tokens{"ab"});
  // Prepend leaves empty text empty.
  EXPECT_TRUE(with_normalizer(prepend, words).encode("").empty());
}

TEST(Normalizer, UnsupportedKindsNameTheFileKeyAndValue) {
  EXPECT_CONTAINS(message_of([] {
                    with_normalizer({{"type", "Precompiled"}}, {"a"});
                  }),
                  "tokenizer 'normalizer-test.json': normalizer.type \"Precompiled\" is not "
                  "supported; supported: NFC, NFD, NFKC, NFKD, Lowercase, Strip, Replace, "
                  "Prepend, Sequence");
  EXPECT_CONTAINS(message_of([] {
                    with_normalizer(
                        {{"type", "Sequence"},
                         {"normalizers", {{{"type", "NFC"}}, {{"type", "BertNormalizer"}}}}},
                        {"a"});
                  }),
                  "normalizer.normalizers[1].type \"BertNormalizer\" is not supported");
  EXPECT_CONTAINS(message_of([] {
                    with_normalizer({{"type", "Replace"}, {"pattern", {{"String", " "}}}}, {"a"});
                  }),
                  "normalizer.content must be a string");
  EXPECT_CONTAINS(message_of([] {
                    with_normalizer(
                        {{"type", "Replace"}, {"pattern", {{"Regex", "(a"}}}, {"content", "b"}},
                        {"a"});
                  }),
                  "normalizer.pattern: cannot compile the regex /(a/");
}

}  // namespace
