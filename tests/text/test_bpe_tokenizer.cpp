// The byte-level BPE tokenizer against HF `tokenizers`: the ids and decoded text HF produced for
// every line of the fixture corpus (tests/fixtures/hf/make_fixtures.py), for a Llama-3-style file
// (Split regex + ByteLevel, [a, b] merges, ignore_merges, a BOS template) and a GPT-2-style one
// (ByteLevel's own regex, "a b" merges); and clear errors for what it does not support.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>

#include "dtensor/text/bpe_tokenizer.h"
#include "support/errors.h"

using dtensor::testing::message_of;
using dtensor::text::BpeTokenizer;
using nlohmann::json;

namespace {

const std::string kDir = DTENSOR_HF_FIXTURES;

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class MatchesHF : public ::testing::TestWithParam<std::string> {};

TEST_P(MatchesHF, EveryCorpusLine) {
  const std::string file = GetParam();
  const auto tok = BpeTokenizer::from_file(kDir + "/" + file);
  const json ref = json::parse(read(kDir + "/tokenizer_reference.json")).at(file);
  EXPECT_EQ(tok.vocab_size(), ref.at("vocab_size").get<int64_t>());
  size_t n = 0;
  for (const auto& line : ref.at("lines")) {
    const auto text = line.at("text").get<std::string>();
    SCOPED_TRACE(file + ": \"" + text + "\"");
    const auto ids = line.at("ids").get<std::vector<int64_t>>();
    EXPECT_EQ(tok.encode(text), ids);
    EXPECT_EQ(tok.encode(text, /*add_special_tokens=*/true),
              line.at("ids_with_special").get<std::vector<int64_t>>());
    EXPECT_EQ(tok.decode(ids), line.at("decoded").get<std::string>());
    EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true),
              line.at("decoded_skip_special").get<std::string>());
    EXPECT_EQ(tok.decode(ids), text) << "round trip";
    ++n;
  }
  EXPECT_GT(n, 15u);
}

INSTANTIATE_TEST_SUITE_P(Files, MatchesHF,
                         ::testing::Values("tokenizer.json", "gpt2_tokenizer.json"),
                         [](const auto& info) {
                           return info.param == "tokenizer.json" ? "llama3" : "gpt2";
                         });

TEST(BpeTokenizer, TokensAndSpecials) {
  const auto tok = BpeTokenizer::from_file(kDir + "/tokenizer.json");
  const auto bos = tok.token_to_id("<|begin_of_text|>");
  ASSERT_TRUE(bos.has_value());
  EXPECT_TRUE(tok.is_special(*bos));
  EXPECT_EQ(tok.id_to_token(*bos), "<|begin_of_text|>");
  EXPECT_EQ(tok.encode("x", true).front(), *bos);
  // A special token inside text is one id, whatever surrounds it.
  const auto ids = tok.encode("a<|eot_id|>b");
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], *tok.token_to_id("<|eot_id|>"));
  // Decoding half of a two-byte character gives U+FFFD, as HF's lossy decoding does.
  const auto e_acute = tok.encode("\xC3\xA9");       // é: bytes C3 A9
  const auto byte_c3 = tok.token_to_id("\xC3\x83");  // the byte-level character for 0xC3
  ASSERT_TRUE(byte_c3.has_value());
  EXPECT_EQ(tok.decode({*byte_c3}), "\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode(e_acute), "\xC3\xA9");
  EXPECT_FALSE(tok.token_to_id("no such token").has_value());
}

TEST(BpeTokenizer, Errors) {
  const std::string path = kDir + "/tokenizer.json";
  const auto tok = BpeTokenizer::from_file(path);
  EXPECT_CONTAINS(message_of([&] { tok.encode("bad \xFF byte"); }), "not valid UTF-8 at byte 4");
  EXPECT_CONTAINS(message_of([&] { tok.id_to_token(100000); }),
                  "token id 100000 is not in the vocab");
  EXPECT_CONTAINS(message_of([&] { tok.decode({-1}); }), "token id -1");
  EXPECT_CONTAINS(message_of([] { BpeTokenizer::from_file("/nonexistent/tokenizer.json"); }),
                  "tokenizer '/nonexistent/tokenizer.json': cannot open");

  const json good = json::parse(read(path));
  auto with = [&](const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    return message_of([&] { BpeTokenizer::from_json(j.dump(), "edited.json"); });
  };
  EXPECT_CONTAINS(with([](json&) {}), "(no error)");
  EXPECT_CONTAINS(with([](json& j) { j["model"]["type"] = "WordPiece"; }),
                  "tokenizer 'edited.json': model type \"WordPiece\" is not supported");
  EXPECT_CONTAINS(with([](json& j) {
                    j["normalizer"] = {{"type", "NFC"}};
                  }),
                  "normalizer \"NFC\" is not supported");
  EXPECT_CONTAINS(with([](json& j) {
                    j["pre_tokenizer"] = {{"type", "Whitespace"}};
                  }),
                  "pre_tokenizer \"Whitespace\" is not supported");
  EXPECT_CONTAINS(with([](json& j) { j["pre_tokenizer"] = nullptr; }), "no ByteLevel step");
  EXPECT_CONTAINS(with([](json& j) {
                    j["decoder"] = {{"type", "WordPiece"}};
                  }),
                  "decoder \"WordPiece\" is not supported");
  EXPECT_CONTAINS(with([](json& j) {
                    j["model"]["merges"][0] = {"zzz-not-a-token", "a"};
                  }),
                  "merge 0 uses \"zzz-not-a-token\", which is not in the vocab");
  EXPECT_CONTAINS(with([](json& j) {
                    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
                  }),
                  "cannot compile the regex /(unclosed/");
  EXPECT_CONTAINS(message_of([] { BpeTokenizer::from_json("{not json", "broken.json"); }),
                  "tokenizer 'broken.json': not valid JSON");
}

}  // namespace
