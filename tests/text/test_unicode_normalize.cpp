// Unicode normalization (src/text/unicode_normalize.cpp) against HF `tokenizers`' own NFC, NFD,
// NFKC and NFKD of random strings of combining marks, decomposable characters and starters
// (tests/fixtures/hf/make_normalization_reference.py). HF's tables are Unicode 9.0's: a mark
// assigned since (U+07FD) is a starter to it, so canonical ordering does not move it, and the
// Qwen2 tokenizer's ids for such text are HF's.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtensor/text/bpe_tokenizer.h"
#include "text/unicode_normalize.h"

using dtensor::text::BpeTokenizer;
using dtensor::text::NormalizationForm;
using dtensor::text::unicode_normalize;
using nlohmann::json;

namespace {

const std::string kDir = DTENSOR_HF_FIXTURES;

const json& reference() {
  static const json j = json::parse(std::ifstream(kDir + "/normalization_reference.json"));
  return j;
}

const std::string kIdeograph = "\xE4\xB8\x80";               // U+4E00
const std::string kReversedDamma = "\xD9\x9D";               // U+065D, class 230 (Unicode 4.1)
const std::string kNkoDantayalan = "\xDF\xBD";               // U+07FD, class 220 (Unicode 11)
const std::string kAcute = "\xCC\x81";                       // U+0301, class 230
const std::string kDotBelow = "\xCC\xA3";                    // U+0323, class 220
const std::string kEDotBelowAcute = "\xE1\xBA\xB9\xCC\x81";  // ẹ + U+0301

TEST(UnicodeNormalize, OrdersMarksHfKnowsByCombiningClass) {
  EXPECT_EQ(unicode_normalize("e" + kAcute + kDotBelow, NormalizationForm::NFC), kEDotBelowAcute);
  EXPECT_EQ(unicode_normalize(kIdeograph + kAcute + kDotBelow, NormalizationForm::NFD),
            kIdeograph + kDotBelow + kAcute);
}

TEST(UnicodeNormalize, MarkNewerThanHfsTablesStaysInPlace) {
  for (auto form : {NormalizationForm::NFC, NormalizationForm::NFD, NormalizationForm::NFKC,
                    NormalizationForm::NFKD}) {
    EXPECT_EQ(unicode_normalize(kIdeograph + kReversedDamma + kNkoDantayalan, form),
              kIdeograph + kReversedDamma + kNkoDantayalan);
  }
}

TEST(UnicodeNormalize, EveryFormEqualsHfOnRandomStrings) {
  const json& ref = reference();
  const auto& texts = ref.at("texts");
  for (const auto& [name, form] :
       std::vector<std::pair<std::string, NormalizationForm>>{{"NFC", NormalizationForm::NFC},
                                                              {"NFD", NormalizationForm::NFD},
                                                              {"NFKC", NormalizationForm::NFKC},
                                                              {"NFKD", NormalizationForm::NFKD}}) {
    const auto& expected = ref.at("forms").at(name);
    ASSERT_EQ(expected.size(), texts.size());
    size_t wrong = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string got = unicode_normalize(texts[i].get<std::string>(), form);
      if (got != expected[i].get<std::string>() && ++wrong <= 3) {
        ADD_FAILURE() << name << " of text " << i << " differs from HF's";
      }
    }
    EXPECT_EQ(wrong, 0u) << name << " differs from HF on " << wrong << " of " << texts.size();
  }
}

TEST(UnicodeNormalize, Qwen2IdsEqualHfsForTheReorderingCase) {
  const auto tok = BpeTokenizer::from_file(kDir + "/qwen2_tokenizer.json");
  const json& c = reference().at("qwen2_case");
  EXPECT_EQ(tok.encode(c.at("text").get<std::string>()), c.at("ids").get<std::vector<int64_t>>());
}

TEST(UnicodeNormalize, IllFormedUtf8FailsNamingIt) {
  try {
    unicode_normalize("a\xFF" + kAcute, NormalizationForm::NFC);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("Unicode normalization failed"), std::string::npos)
        << e.what();
  }
}

}  // namespace
