// The decoders of tokenizer.json (src/text/decoder.cpp) as HF `tokenizers` applies them: the
// expected strings are HF's (decoders.X().decode). Each unsupported kind is refused naming the
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
using dtensor::testing::word_tokenizer_json;
using dtensor::text::BpeTokenizer;
using nlohmann::json;

namespace {

const std::string kReplacementChar = "\xEF\xBF\xBD";

// Decodes `tokens` (all in the vocabulary) with `decoder`.
std::string decode(const json& decoder, const std::vector<std::string>& tokens) {
  json j = word_tokenizer_json(tokens);
  j["decoder"] = decoder;
  const auto tok = BpeTokenizer::from_json(j.dump(), "decoder-test.json");
  std::vector<int64_t> ids;
  for (const auto& t : tokens) ids.push_back(*tok.token_to_id(t));
  return tok.decode(ids);
}

TEST(Decoder, StripCutsUpToStartAndStopCharactersOfEachToken) {
  EXPECT_EQ(decode({{"type", "Strip"}, {"content", "x"}, {"start", 2}, {"stop", 1}},
                   {"xxxaxx", "ax", "xa"}),
            "xaxaa");
  // A token of nothing but the content: HF panics; here it becomes empty.
  EXPECT_EQ(decode({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 1}}, {" "}), "");
}

TEST(Decoder, ByteFallbackJoinsByteRunsOrReplacesEachByte) {
  // "<0xZZ>" is no byte; a run that is not UTF-8 gives one U+FFFD per byte.
  EXPECT_EQ(decode({{"type", "ByteFallback"}}, {"<0xZZ>", "<0x61>", "<0xe6>", "<0xbc>", "b"}),
            "<0xZZ>" + kReplacementChar + kReplacementChar + kReplacementChar + "b");
  EXPECT_EQ(decode({{"type", "ByteFallback"}}, {"<0xE6>", "<0xBC>", "<0xA2>"}), "\xE6\xBC\xA2");
}

TEST(Decoder, MetaspaceDropsTheReplacementInTheFirstTokenOnly) {
  EXPECT_EQ(decode({{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "always"}},
                   {kMeta + kMeta + "a", kMeta + "b" + kMeta + "c"}),
            "a b c");
  EXPECT_EQ(decode({{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "never"}},
                   {kMeta + kMeta + "a", kMeta + "b"}),
            "  a b");
}

TEST(Decoder, ReplaceByRegexAndNoDecoderJoinsWithSpaces) {
  EXPECT_EQ(decode({{"type", "Replace"}, {"pattern", {{"Regex", "[0-9]+"}}}, {"content", "#"}},
                   {"a12b3", "x"}),
            "a#b#x");
  EXPECT_EQ(decode(nullptr, {"a", "<0x41>"}), "a <0x41>");
}

TEST(Decoder, UnsupportedKindsNameTheFileKeyAndValue) {
  EXPECT_CONTAINS(message_of([] {
                    decode({{"type", "WordPiece"}}, {"a"});
                  }),
                  "tokenizer 'decoder-test.json': decoder.type \"WordPiece\" is not supported; "
                  "supported: ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence");
  EXPECT_CONTAINS(
      message_of([] {
        decode({{"type", "Sequence"}, {"decoders", {{{"type", "Fuse"}}, {{"type", "CTC"}}}}},
               {"a"});
      }),
      "decoder.decoders[1].type \"CTC\" is not supported");
  EXPECT_CONTAINS(
      message_of([] {
        decode({{"type", "Strip"}, {"content", "ab"}, {"start", 1}, {"stop", 0}}, {"a"});
      }),
      "decoder.content must be one character");
}

}  // namespace
