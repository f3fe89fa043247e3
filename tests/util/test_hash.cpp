// util::splitmix64 and util::fnv1a against the published reference values, and the properties
// the library's callers rely on (a constant expression, a basis that changes the hash).
#include "dtensor/util/hash.h"

#include <gtest/gtest.h>

using dtensor::util::fnv1a;
using dtensor::util::kFnv1aOffsetBasis;
using dtensor::util::splitmix64;
using dtensor::util::splitmix64_mix;

TEST(SplitMix64, DrawsTheReferenceGeneratorsValuesFromState1234567) {
  // Vigna's splitmix64.c seeded with 1234567: its state advances by the increment per draw.
  uint64_t state = 1234567;
  const uint64_t expected[] = {6457827717110365317ULL, 3203168211198807973ULL,
                               9817491932198370423ULL};
  for (uint64_t want : expected) {
    EXPECT_EQ(splitmix64(state), want);
    state += dtensor::util::kSplitMix64Gamma;
  }
}

TEST(SplitMix64, MixIsTheOutputFunctionWithoutTheIncrement) {
  EXPECT_EQ(splitmix64_mix(1234567 + dtensor::util::kSplitMix64Gamma), splitmix64(1234567));
  EXPECT_EQ(splitmix64_mix(0), 0u);  // a bijection that fixes zero
  static_assert(splitmix64(1234567) == 6457827717110365317ULL, "usable in constant expressions");
}

TEST(Fnv1a, HashesTextAsTheReference64BitFnv1a) {
  EXPECT_EQ(fnv1a(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(fnv1a("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(fnv1a("foobar"), 0x85944171f73967e8ULL);
  EXPECT_EQ(fnv1a("", 42), 42u);  // no bytes: the basis itself
  EXPECT_NE(fnv1a("foobar", kFnv1aOffsetBasis ^ 1), fnv1a("foobar"));
}

TEST(Fnv1a, ReadsBytesAboveSevenBitsAsUnsigned) {
  // 0xff is 255, not -1: the hash of a byte does not depend on char's signedness.
  EXPECT_EQ(fnv1a("\xff"), (kFnv1aOffsetBasis ^ 0xffULL) * dtensor::util::kFnv1aPrime);
}
