#pragma once
// Unicode normalization forms as HF `tokenizers` computes them: utf8proc's algorithms with the
// character data of HF's tables (Unicode 9.0), so a character assigned since is left as it is.
#include <string>
#include <string_view>

namespace dtensor::text {

enum class NormalizationForm { NFC, NFD, NFKC, NFKD };

/// `s` (valid UTF-8) in `form`; ill-formed UTF-8 fails naming the problem.
std::string unicode_normalize(std::string_view s, NormalizationForm form);

}  // namespace dtensor::text
