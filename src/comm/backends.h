#pragma once
// Factories for the c10d backends, each in its own translation unit so that only one file
// sees gloo's (NCCL's, MPI's) headers.
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace dtensor::comm::detail {

// Connecting the full mesh may take up to `connect_timeout` (peers arrive at their own pace on
// a busy machine); collectives then time out after `timeout`.
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds connect_timeout,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& host);

// Returns nullptr when this build has no NCCL.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);
bool has_nccl();

// True when CPU collectives block the caller until done and cannot time out by themselves
// (the MPI backend): collectives.cpp then runs them inside a BlockingSection.
bool cpu_collectives_block();

// The MPI communicator over `global_ranks` (this process is group rank `rank`), joining the
// MPI job on first use. Returns nullptr when this build has no MPI (see has_mpi()).
c10::intrusive_ptr<c10d::Backend> make_mpi_backend(const std::vector<int>& global_ranks, int rank,
                                                   const std::string& name);

}  // namespace dtensor::comm::detail
