#include "dtensor/checkpoint/remove_directory.h"

#include <vector>

namespace dtensor::checkpoint {

std::uintmax_t remove_directory(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  const fs::file_status status = fs::symlink_status(path);
  if (!fs::exists(status)) return 0;
  std::uintmax_t removed = 0;
  if (fs::is_directory(status)) {
    // Collected first: removing entries while iterating leaves the iterator's position unspecified.
    std::vector<fs::path> entries;
    for (const auto& e : fs::directory_iterator(path)) entries.push_back(e.path());
    for (const auto& e : entries) removed += remove_directory(e);
  }
  fs::remove(path);
  return removed + 1;
}

}  // namespace dtensor::checkpoint
