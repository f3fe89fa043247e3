#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <optional>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dtensor/comm/store_server.h"

namespace {

// Whether a TCP connection to [::1]:port is accepted; nullopt when this machine has no IPv6
// loopback to try.
std::optional<bool> accepts_on_ipv6_loopback(int port) {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  a.sin6_port = htons(static_cast<uint16_t>(port));
  const int r = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  const int err = errno;
  ::close(fd);
  if (r == 0) return true;
  if (err == ECONNREFUSED) return false;
  return std::nullopt;  // EADDRNOTAVAIL, ENETUNREACH: no IPv6 here
}

c10d::TCPStoreOptions server_options() {
  c10d::TCPStoreOptions o;
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(10);
  return o;
}

}  // namespace

// c10d names each accepted peer by a reverse lookup; a dual-stack server sees an IPv4 client as
// ::ffff:127.0.0.1, which no hosts file lists, so every rank's join cost a DNS query (and, where
// the resolver dropped one, a 5 s stall). For an IPv4 address the server listens on IPv4 only.
TEST(StoreServer, ListensOnIpv4OnlyForAnIpv4AddressAndServesClients) {
  auto server = dtensor::comm::start_store_server("127.0.0.1", 0, server_options());
  const int port = server->getPort();
  ASSERT_GT(port, 0);
  c10d::TCPStoreOptions c = server_options();
  c.port = static_cast<uint16_t>(port);
  c.isServer = false;
  auto client = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", c);
  client->set("key", std::vector<uint8_t>{1, 2, 3});
  EXPECT_EQ(server->get("key"), (std::vector<uint8_t>{1, 2, 3}));
  const auto v6 = accepts_on_ipv6_loopback(port);
  if (!v6) GTEST_SKIP() << "no IPv6 loopback on this machine to check the listener against";
  EXPECT_FALSE(*v6) << "the store for 127.0.0.1 also listens on IPv6";
}

TEST(StoreServer, AHostNameKeepsTheDualStackListener) {
  auto server = dtensor::comm::start_store_server("localhost", 0, server_options());
  const auto v6 = accepts_on_ipv6_loopback(server->getPort());
  if (!v6) GTEST_SKIP() << "no IPv6 loopback on this machine";
  EXPECT_TRUE(*v6);
}
