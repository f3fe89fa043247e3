// The pre-tokenizers of tokenizer.json (src/text/pre_tokenizer.cpp) as HF `tokenizers` applies
// them, seen through the tokens of a word-level vocabulary: the expected words are HF's
// (pre_tokenizers.X().pre_tokenize_str). Each unsupported kind or option is refused naming the
// file, the key and the value.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtensor/text/bpe_tokenizer.h"
#include "support/errors.h"
#include "support/tokenizer_json.h"

using dtensor::testing::kMeta;
using dtensor::testing::message_of;
using dtensor::testing::tokens_of;
using dtensor::testing::word_tokenizer_json;
using dtensor::text::BpeTokenizer;
using nlohmann::json;
using Tokens = std::vector<std::string>;

namespace {

BpeTokenizer with_pre_tokenizer(const json& pre, const std::vector<std::string>& words,
                                const json& added = json::array()) {
  json j = word_tokenizer_json(words);
  j["pre_tokenizer"] = pre;
  j["added_tokens"] = added;
  return BpeTokenizer::from_json(j.dump(), "pre-tokenizer-test.json");
}

json split(const std::string& behavior, bool invert) {
  return {{"type", "Split"},
          {"pattern", {{"String", "-"}}},
          {"behavior", behavior},
          {"invert", invert}};
}

TEST(PreTokenizer, SplitBehaviorsAsHF) {
  const std::vector<std::string> words{"a", "b", "c", "-", "--", "a-", "b-", "-b", "-c"};
  const std::string text = "a-b--c";
  const auto words_of = [&](const std::string& behavior, bool invert) {
    return tokens_of(with_pre_tokenizer(split(behavior, invert), words), text);
  };
  EXPECT_EQ(words_of("Removed", false), (Tokens{"a", "b", "c"}));
  EXPECT_EQ(words_of("Removed", true), (Tokens{"-", "-", "-"}));
  EXPECT_EQ(words_of("Isolated", false), (Tokens{"a", "-", "b", "-", "-", "c"}));
  EXPECT_EQ(words_of("MergedWithPrevious", false), (Tokens{"a-", "b-", "-", "c"}));
  EXPECT_EQ(words_of("MergedWithPrevious", true), (Tokens{"a", "-b", "-", "-c"}));
  EXPECT_EQ(words_of("MergedWithNext", false), (Tokens{"a", "-b", "-", "-c"}));
  EXPECT_EQ(words_of("MergedWithNext", true), (Tokens{"a-", "b-", "-", "c"}));
  EXPECT_EQ(words_of("Contiguous", false), (Tokens{"a", "-", "b", "--", "c"}));
}

TEST(PreTokenizer, MetaspaceSplitsAndPrepends) {
  const std::vector<std::string> words{kMeta + "hello", kMeta, kMeta + "big", kMeta + "world",
                                       "hello" + kMeta + kMeta + "big" + kMeta + "world"};
  EXPECT_EQ(tokens_of(with_pre_tokenizer({{"type", "Metaspace"},
                                          {"replacement", kMeta},
                                          {"prepend_scheme", "always"},
                                          {"split", true}},
                                         words),
                      "hello  big world"),
            (Tokens{kMeta + "hello", kMeta, kMeta + "big", kMeta + "world"}));
  EXPECT_EQ(tokens_of(with_pre_tokenizer({{"type", "Metaspace"},
                                          {"replacement", kMeta},
                                          {"prepend_scheme", "never"},
                                          {"split", false}},
                                         words),
                      "hello  big world"),
            Tokens{"hello" + kMeta + kMeta + "big" + kMeta + "world"});
}

TEST(PreTokenizer, MetaspaceFirstPrependsOnlyAtTheStartOfTheText) {
  // As HF: "<x>a a" is <x>, "a", "▁a": the text after an added token does not start the input.
  const json added =
      json::array({{{"id", 100}, {"content", "<x>"}, {"special", true}, {"normalized", false}}});
  const auto tok = with_pre_tokenizer(
      {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "first"}, {"split", true}},
      {"a", kMeta + "a"}, added);
  EXPECT_EQ(tokens_of(tok, "a a"), (Tokens{kMeta + "a", kMeta + "a"}));
  EXPECT_EQ(tokens_of(tok, "<x>a a"), (Tokens{"<x>", "a", kMeta + "a"}));
  EXPECT_EQ(tokens_of(tok, "a<x>a"), (Tokens{kMeta + "a", "<x>", "a"}));
  // Files from before prepend_scheme carry add_prefix_space (true: always).
  const auto legacy = with_pre_tokenizer(
      {{"type", "Metaspace"}, {"replacement", kMeta}, {"add_prefix_space", true}},
      {"a", kMeta + "a"}, added);
  EXPECT_EQ(tokens_of(legacy, "<x>a"), (Tokens{"<x>", kMeta + "a"}));
}

TEST(PreTokenizer, ByteLevelPrefixSpace) {
  const std::string g = "\xC4\xA0";  // Ġ, the byte-level character of a space
  const auto tok =
      with_pre_tokenizer({{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}},
                         {g + "hi", g + "there"});
  EXPECT_EQ(tokens_of(tok, "hi there"), (Tokens{g + "hi", g + "there"}));
}

TEST(PreTokenizer, UnsupportedKindsAndOptionsNameTheFileKeyAndValue) {
  EXPECT_CONTAINS(message_of([] {
                    with_pre_tokenizer({{"type", "BertPreTokenizer"}}, {"a"});
                  }),
                  "tokenizer 'pre-tokenizer-test.json': pre_tokenizer.type \"BertPreTokenizer\" "
                  "is not supported; supported: Split, ByteLevel, Metaspace, Sequence");
  EXPECT_CONTAINS(message_of([] {
                    with_pre_tokenizer(
                        {{"type", "Sequence"},
                         {"pretokenizers", {split("Isolated", false), {{"type", "Whitespace"}}}}},
                        {"a"});
                  }),
                  "pre_tokenizer.pretokenizers[1].type \"Whitespace\" is not supported");
  EXPECT_CONTAINS(message_of([] { with_pre_tokenizer(split("Sideways", false), {"a"}); }),
                  "pre_tokenizer.behavior \"Sideways\" is not supported; supported: Removed, "
                  "Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
  EXPECT_CONTAINS(
      message_of([] {
        with_pre_tokenizer(
            {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "sometimes"}},
            {"a"});
      }),
      "pre_tokenizer.prepend_scheme \"sometimes\" is not supported; supported: "
      "always, first, never");
}

}  // namespace
