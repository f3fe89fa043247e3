#pragma once
// Removing a directory tree without std::filesystem::remove_all.
#include <cstdint>
#include <filesystem>

namespace dtensor::checkpoint {

/// Removes `path` and everything in it, as std::filesystem::remove_all does (symbolic links are
/// removed, never followed), and returns how many entries were removed (0 when `path` does not
/// exist). Throws std::filesystem::filesystem_error naming the path that could not be removed.
///
/// Why not remove_all: the libtorch.so of the LibTorch 2.11 wheels defines its own
/// std::filesystem::remove_all, which calls recursive_directory_iterator internals through weak
/// references; where the process's libstdc++ lacks them, a program whose calls bind to
/// libtorch.so's copy jumps to address 0. This walks the tree with directory_iterator only.
std::uintmax_t remove_directory(const std::filesystem::path& path);

}  // namespace dtensor::checkpoint
