#include "dtensor/comm/store_server.h"

#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace dtensor::comm {
namespace {

// A socket bound to every IPv4 address at `port` (0: a free one), or -1 when that fails (then
// c10d listens the usual way and reports what is wrong).
int ipv4_socket(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int bound_port(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return -1;
  return ntohs(a.sin_port);
}

}  // namespace

c10::intrusive_ptr<c10d::TCPStore> start_store_server(const std::string& addr, int port,
                                                      c10d::TCPStoreOptions options) {
  options.isServer = true;
  options.port = static_cast<uint16_t>(port);
  in_addr ipv4{};
  if (::inet_pton(AF_INET, addr.c_str(), &ipv4) == 1) {
    const int fd = ipv4_socket(port);
    if (fd >= 0) {
      const int p = bound_port(fd);
      if (p > 0) {
        options.port = static_cast<uint16_t>(p);
        options.masterListenFd = fd;  // the server owns it from here
      } else {
        ::close(fd);
      }
    }
  }
  return c10::make_intrusive<c10d::TCPStore>(addr, options);
}

}  // namespace dtensor::comm
