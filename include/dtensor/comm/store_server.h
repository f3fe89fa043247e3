#pragma once
// Hosting the rendezvous store (c10d's TCPStore server) for a job.
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace dtensor::comm {

/// Starts a TCPStore server for a job whose ranks reach it at `addr`:`port` (port 0: a free
/// port, read back with getPort()). When `addr` is an IPv4 address the server listens on IPv4
/// only: c10d names every connection it accepts by a reverse lookup of the peer's address, and
/// a dual-stack server sees an IPv4 peer as "::ffff:a.b.c.d", which no hosts file lists, so each
/// connection cost a DNS query; on a machine whose resolver drops a query now and then, that
/// stalled a rank's join for the resolver's 5 s retry. An IPv4 peer is found in /etc/hosts.
c10::intrusive_ptr<c10d::TCPStore> start_store_server(const std::string& addr, int port,
                                                      c10d::TCPStoreOptions options);

}  // namespace dtensor::comm
