#pragma once
// The library's two hashes, each written once: SplitMix64 (Steele, Lea and Flood, "Fast
// splittable pseudorandom number generators", 2014) for counter-based random streams and seeds,
// and 64-bit FNV-1a for text. Both give the same value in every build, on every rank and
// platform, which std::hash does not promise.
#include <cstdint>
#include <string_view>

namespace dtensor::util {

/// SplitMix64's increment: 2^64 divided by the golden ratio, odd.
inline constexpr uint64_t kSplitMix64Gamma = 0x9e3779b97f4a7c15ULL;

/// SplitMix64's output function: a bijective mix of all 64 bits of `z` (MurmurHash3's
/// finalizer with Stafford's "Mix13" constants).
constexpr uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// The value SplitMix64 draws from the state `x`: its output after advancing `x` by one
/// increment (from state 1234567 the reference generator's first value, 6457827717110365317).
constexpr uint64_t splitmix64(uint64_t x) { return splitmix64_mix(x + kSplitMix64Gamma); }

/// FNV-1a's offset basis and prime (64-bit).
inline constexpr uint64_t kFnv1aOffsetBasis = 14695981039346656037ULL;
inline constexpr uint64_t kFnv1aPrime = 1099511628211ULL;

/// 64-bit FNV-1a of the bytes of `text`, starting from `basis` (the standard offset basis, or
/// one mixed with a seed for a family of hashes).
constexpr uint64_t fnv1a(std::string_view text, uint64_t basis = kFnv1aOffsetBasis) {
  uint64_t h = basis;
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= kFnv1aPrime;
  }
  return h;
}

}  // namespace dtensor::util
