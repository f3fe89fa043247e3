// CRC-32C against the published check values (RFC 3720 appendix B.4 and the CRC catalogue's
// "123456789"), and the SSE4.2 path against the table-driven one at every alignment.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "dtensor/checkpoint/crc32c.h"

using dtensor::checkpoint::crc32c;
using dtensor::checkpoint::detail::crc32c_portable;

TEST(Crc32c, MatchesPublishedCheckValues) {
  const std::string digits = "123456789";
  std::vector<uint8_t> zeros(32, 0x00), ones(32, 0xFF), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<uint8_t>(i);
    dec[i] = static_cast<uint8_t>(31 - i);
  }
  for (auto f : {&crc32c, &crc32c_portable}) {
    EXPECT_EQ(f(digits.data(), digits.size(), 0), 0xE3069283u);
    EXPECT_EQ(f(zeros.data(), zeros.size(), 0), 0x8A9136AAu);
    EXPECT_EQ(f(ones.data(), ones.size(), 0), 0x62A8AB43u);
    EXPECT_EQ(f(inc.data(), inc.size(), 0), 0x46DD794Eu);
    EXPECT_EQ(f(dec.data(), dec.size(), 0), 0x113FDB5Cu);
    EXPECT_EQ(f(nullptr, 0, 0), 0u);
  }
}

TEST(Crc32c, FastPathEqualsPortableAtEveryLengthAndAlignmentAndContinues) {
  std::mt19937 gen(0);
  std::vector<uint8_t> buf(300);
  for (auto& b : buf) b = static_cast<uint8_t>(gen());
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t len = 0; offset + len <= buf.size(); len += (len < 40 ? 1 : 17)) {
      const uint8_t* p = buf.data() + offset;
      const uint32_t whole = crc32c_portable(p, len);
      ASSERT_EQ(crc32c(p, len), whole) << "offset " << offset << " length " << len;
      const size_t cut = len / 3;
      ASSERT_EQ(crc32c(p + cut, len - cut, crc32c(p, cut)), whole) << "split at " << cut;
    }
  }
}
