#pragma once
// A whole file's bytes in and out, for tests that inspect or damage what the library wrote.
#include <fstream>
#include <iterator>
#include <string>

namespace dtensor::testing {

// The file's bytes ("" when it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Replaces the file's contents by `bytes`.
inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace dtensor::testing
