// util::write_file_atomically: the whole new file or the old one, never a temporary left behind.
#include "dtensor/util/atomic_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "support/errors.h"
#include "support/temp_dir.h"

using dtensor::testing::message_of;
using dtensor::testing::TempDir;
using dtensor::util::write_file_atomically;

namespace {

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST(AtomicFile, ReplacesTheFileWholeAndLeavesNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("latest");
  write_file_atomically(path, "step_000001.safetensors\n", "test");
  EXPECT_EQ(read(path), "step_000001.safetensors\n");
  const std::string bytes("a\0b", 3);  // binary content passes through unchanged
  write_file_atomically(path, bytes, "test");
  EXPECT_EQ(read(path), bytes);
  write_file_atomically(path, "", "test");
  EXPECT_EQ(read(path), "");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"latest"});
}

TEST(AtomicFile, AFailureNamesTheCallerTheFileAndTheStepAndKeepsTheOldFile) {
  TempDir dir;
  const std::string missing = dir.file("no/such/folder/config.json");
  const std::string err = message_of([&] { write_file_atomically(missing, "{}", "save_hf"); });
  EXPECT_NE(err.find("save_hf: cannot write '" + missing + "': creating '"), std::string::npos)
      << err;
  EXPECT_NE(err.find("No such file or directory"), std::string::npos) << err;

  // A rename onto a folder fails after the temporary was written: it is removed again and the
  // folder stays as it was.
  const std::string target = dir.file("occupied");
  std::filesystem::create_directory(target);
  std::ofstream(target + "/inside") << "x";
  const std::string err2 = message_of([&] { write_file_atomically(target, "text", "test"); });
  EXPECT_NE(err2.find("test: cannot write '" + target + "': renaming '"), std::string::npos)
      << err2;
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"occupied"});
  EXPECT_EQ(read(target + "/inside"), "x");
}
