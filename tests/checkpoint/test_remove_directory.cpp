// checkpoint::remove_directory: std::filesystem::remove_all's behaviour without its
// recursive_directory_iterator (which LibTorch 2.11's libtorch.so can take over).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dtensor/checkpoint/remove_directory.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using dtensor::checkpoint::remove_directory;
using dtensor::testing::TempDir;

namespace {
void write(const fs::path& p) { std::ofstream(p) << "x"; }
}  // namespace

TEST(RemoveDirectory, RemovesANestedTreeAndCountsEveryEntry) {
  TempDir tmp;
  const fs::path root = tmp.path() / "tree";
  fs::create_directories(root / "a" / "b" / "c");
  fs::create_directories(root / "empty");
  write(root / "top.txt");
  write(root / "a" / "one");
  write(root / "a" / "b" / "c" / "deep");
  // root, a, b, c, empty, top.txt, one, deep
  EXPECT_EQ(remove_directory(root), 8u);
  EXPECT_FALSE(fs::exists(root));
  EXPECT_EQ(tmp.entries(), std::vector<std::string>{});
}

TEST(RemoveDirectory, RemovesSymbolicLinksWithoutFollowingThem) {
  TempDir tmp;
  const fs::path kept = tmp.path() / "kept", root = tmp.path() / "tree";
  fs::create_directories(kept);
  write(kept / "data");
  fs::create_directories(root);
  fs::create_directory_symlink(kept, root / "link_to_dir");
  fs::create_symlink(tmp.path() / "nowhere", root / "dangling");
  EXPECT_EQ(remove_directory(root), 3u);
  EXPECT_FALSE(fs::exists(fs::symlink_status(root)));
  EXPECT_TRUE(fs::exists(kept / "data"));  // the link's target is untouched
}

TEST(RemoveDirectory, AMissingPathRemovesNothingAndAFileIsRemoved) {
  TempDir tmp;
  EXPECT_EQ(remove_directory(tmp.path() / "missing"), 0u);
  write(tmp.path() / "file");
  EXPECT_EQ(remove_directory(tmp.path() / "file"), 1u);
  EXPECT_FALSE(fs::exists(tmp.path() / "file"));
}
