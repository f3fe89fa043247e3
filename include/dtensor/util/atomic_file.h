#pragma once
// Replacing a small file whole: a reader, or a machine that crashes meanwhile, finds either the
// old file or all of the new one, never a part. The safetensors writer streams its large files
// the same way (checkpoint/safetensors.h) and ends with sync_directory_of too.
#include <string>
#include <string_view>

namespace dtensor::util {

/// Writes `bytes` to a temporary beside `path` ("<path>.tmp-<pid>"), fsyncs it, renames it over
/// `path` and fsyncs the folder, so that the rename survives a crash as well. On failure the
/// temporary is removed, `path` is left as it was, and a c10::Error says
/// "<who>: cannot write '<path>': <the step> failed: <the system's reason>".
void write_file_atomically(const std::string& path, std::string_view bytes, const std::string& who);

/// Flushes the entry of `path` in its folder (after a rename into it) to disk. Best effort: a
/// file system that does not let a folder be opened or synced is left alone.
void sync_directory_of(const std::string& path);

}  // namespace dtensor::util
