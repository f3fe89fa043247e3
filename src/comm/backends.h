#pragma once
// Factories for the c10d backends, each in its own translation unit so that only one file
// sees gloo's (or NCCL's) headers.
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace dtensor::comm::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& host);

// Returns nullptr when this build has no NCCL.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);
bool has_nccl();

}  // namespace dtensor::comm::detail
