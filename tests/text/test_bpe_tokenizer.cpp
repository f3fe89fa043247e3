// The BPE tokenizer against HF `tokenizers`: the ids and decoded text HF produced for every test
// line, for a Llama-3-style file (Split regex + ByteLevel, [a, b] merges, ignore_merges, a BOS
// template) and a GPT-2-style one (ByteLevel's own regex, "a b" merges) from
// tests/fixtures/hf/make_fixtures.py; for the Qwen2/Qwen3, Gemma and Llama-2/Mistral families
// (SentencePiece-style BPE with byte_fallback) and two files of the remaining components, on text
// from installed packages, Unicode-heavy and NFD lines included
// (tests/fixtures/hf/make_tokenizer_families.py); and clear errors for what it does not support.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>

#include "dtensor/text/bpe_tokenizer.h"
#include "support/errors.h"
#include "support/temp_dir.h"

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

// Every line exactly as HF: encode with and without the template, decode with and without
// skip_special_tokens. No round trip is asserted: NFC, Strip and Lowercase change the text.
class FamilyMatchesHF : public ::testing::TestWithParam<std::string> {};

TEST_P(FamilyMatchesHF, EveryTestLine) {
  const std::string file = GetParam() + "_tokenizer.json";
  const auto tok = BpeTokenizer::from_file(kDir + "/" + file);
  const json ref = json::parse(read(kDir + "/tokenizer_families_reference.json")).at(file);
  EXPECT_EQ(tok.vocab_size(), ref.at("vocab_size").get<int64_t>());
  size_t n = 0;
  for (const auto& line : ref.at("lines")) {
    const auto text = line.at("text").get<std::string>();
    SCOPED_TRACE(file + ": " + json(text).dump());
    const auto ids = line.at("ids").get<std::vector<int64_t>>();
    EXPECT_EQ(tok.encode(text), ids);
    EXPECT_EQ(tok.encode(text, /*add_special_tokens=*/true),
              line.at("ids_with_special").get<std::vector<int64_t>>());
    EXPECT_EQ(tok.decode(ids), line.at("decoded").get<std::string>());
    EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true),
              line.at("decoded_skip_special").get<std::string>());
    ++n;
  }
  EXPECT_GT(n, 50u);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyMatchesHF,
                         ::testing::Values("qwen2", "gemma", "llama_spm", "llama2_legacy",
                                           "components_spm", "components_byte_level"),
                         [](const auto& info) { return info.param; });

TEST(BpeTokenizer, QwenNormalizesToNFC) {
  const auto tok = BpeTokenizer::from_file(kDir + "/qwen2_tokenizer.json");
  // "Café" with a combining acute accent (NFD) and with the precomposed é (NFC).
  EXPECT_EQ(tok.encode("Cafe\xCC\x81"), tok.encode("Caf\xC3\xA9"));
  EXPECT_EQ(tok.decode(tok.encode("Cafe\xCC\x81")), "Caf\xC3\xA9");
}

TEST(BpeTokenizer, ByteFallbackForCharactersOutsideTheVocab) {
  for (const char* file : {"gemma_tokenizer.json", "llama2_legacy_tokenizer.json"}) {
    SCOPED_TRACE(file);
    const auto tok = BpeTokenizer::from_file(kDir + "/" + file);
    const std::string han = "\xE6\xBC\xA2";  // U+6F22, not in the trained vocabulary
    ASSERT_FALSE(tok.token_to_id(han).has_value());
    const auto b = [&](const char* name) { return *tok.token_to_id(name); };
    const std::vector<int64_t> bytes{b("<0xE6>"), b("<0xBC>"), b("<0xA2>")};
    const auto ids = tok.encode(han);
    ASSERT_GE(ids.size(), 3u);
    EXPECT_EQ(std::vector<int64_t>(ids.end() - 3, ids.end()), bytes);
    EXPECT_EQ(tok.decode(bytes), han);
    // A cut sequence: one U+FFFD per byte (ByteFallback), not per maximal subpart.
    EXPECT_EQ(tok.decode({b("<0xE6>"), b("<0xBC>")}), "\xEF\xBF\xBD\xEF\xBF\xBD");
  }
}

TEST(BpeTokenizer, UnknownCharactersWithoutFuseUnk) {
  // components_spm has byte tokens for ASCII only and fuse_unk false: each unknown character
  // is one <unk>.
  const auto tok = BpeTokenizer::from_file(kDir + "/components_spm_tokenizer.json");
  const int64_t unk = *tok.token_to_id("<unk>");
  const auto ids = tok.encode("\xE6\xBC\xA2\xE6\xBC\xA2");  // two CJK characters
  EXPECT_EQ(std::count(ids.begin(), ids.end(), unk), 2);
}

TEST(BpeTokenizer, UnsupportedComponentOfAFileNamesItsPathKeyAndValue) {
  // A Gemma file whose normalizer became SentencePiece's precompiled charsmap (T5's kind).
  json j = json::parse(read(kDir + "/gemma_tokenizer.json"));
  j["normalizer"] = {
      {"type", "Sequence"},
      {"normalizers",
       {{{"type", "Precompiled"}, {"precompiled_charsmap", "AAAA"}}, j["normalizer"]}}};
  dtensor::testing::TempDir dir;
  const std::string path = dir.file("tokenizer.json");
  std::ofstream(path) << j.dump();
  EXPECT_CONTAINS(
      message_of([&] { BpeTokenizer::from_file(path); }),
      "tokenizer '" + path + "': normalizer.normalizers[0].type \"Precompiled\" is not supported");
}

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
                  "tokenizer 'edited.json': model.type \"WordPiece\" is not supported; "
                  "supported: BPE");
  EXPECT_CONTAINS(with([](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }),
                  "model.continuing_subword_prefix \"##\" is not supported");
  EXPECT_CONTAINS(with([](json& j) { j["model"]["dropout"] = 0.1; }),
                  "model.dropout 0.1 is not supported");
  EXPECT_CONTAINS(with([](json& j) {
                    j["pre_tokenizer"] = {{"type", "Whitespace"}};
                  }),
                  "pre_tokenizer.type \"Whitespace\" is not supported; supported: Split, "
                  "ByteLevel, Metaspace, Sequence");
  EXPECT_CONTAINS(with([](json& j) {
                    j["pre_tokenizer"]["pretokenizers"][1] = {{"type", "Digits"}};
                  }),
                  "pre_tokenizer.pretokenizers[1].type \"Digits\" is not supported");
  EXPECT_CONTAINS(with([](json& j) {
                    j["decoder"] = {{"type", "WordPiece"}};
                  }),
                  "decoder.type \"WordPiece\" is not supported");
  EXPECT_CONTAINS(with([](json& j) {
                    j["post_processor"] = {{"type", "RobertaProcessing"}};
                  }),
                  "post_processor.type \"RobertaProcessing\" is not supported");
  EXPECT_CONTAINS(with([](json& j) { j["added_tokens"][0]["single_word"] = true; }),
                  "added_tokens[0].single_word true is not supported");
  EXPECT_CONTAINS(with([](json& j) {
                    j["model"]["merges"][0] = {"zzz-not-a-token", "a"};
                  }),
                  "model.merges[0] uses \"zzz-not-a-token\", which is not in the vocab");
  EXPECT_CONTAINS(with([](json& j) {
                    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
                  }),
                  "tokenizer 'edited.json': pre_tokenizer.pretokenizers[0].pattern: cannot "
                  "compile the regex /(unclosed/");
  EXPECT_CONTAINS(message_of([] { BpeTokenizer::from_json("{not json", "broken.json"); }),
                  "tokenizer 'broken.json': not valid JSON");
}

}  // namespace
