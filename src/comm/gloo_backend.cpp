// The one translation unit that includes gloo's headers (see cmake/GlooHeaders.cmake).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <algorithm>
#include <cstdlib>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "backends.h"

namespace dtensor::comm::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds connect_timeout,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& host) {
  auto opts = c10d::ProcessGroupGloo::Options::create(std::max(connect_timeout, timeout));
  if (!host.empty()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(host));
  } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  opts->threads = 2;
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  backend->setTimeout(timeout);
  return backend;
}

}  // namespace dtensor::comm::detail
