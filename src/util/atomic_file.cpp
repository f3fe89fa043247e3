#include "dtensor/util/atomic_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace dtensor::util {

void write_file_atomically(const std::string& path, std::string_view bytes,
                           const std::string& who) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, who, ": cannot write '", path, "': creating '", tmp,
              "' failed: ", std::strerror(errno));
  std::string failed;  // the step that failed, with its errno
  int error = 0;
  auto fail = [&](std::string step) {
    if (!failed.empty()) return;
    error = errno;
    failed = std::move(step);
  };
  for (const char* p = bytes.data(); failed.empty() && p < bytes.data() + bytes.size();) {
    const ssize_t n = ::write(fd, p, static_cast<size_t>(bytes.data() + bytes.size() - p));
    if (n > 0) {
      p += n;
    } else if (n == 0 || errno != EINTR) {
      if (n == 0) errno = EIO;  // no progress on a regular file: give up rather than spin
      fail("writing '" + tmp + "'");
    }
  }
  if (failed.empty() && ::fsync(fd) != 0) fail("flushing '" + tmp + "'");
  if (::close(fd) != 0) fail("closing '" + tmp + "'");
  if (failed.empty() && ::rename(tmp.c_str(), path.c_str()) != 0)
    fail("renaming '" + tmp + "' to it");
  if (!failed.empty()) {
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, who, ": cannot write '", path, "': ", failed,
                " failed: ", std::strerror(error));
  }
  sync_directory_of(path);
}

void sync_directory_of(const std::string& path) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace dtensor::util
