#pragma once
// CUDA tests (tests/cuda/): whether a GPU is visible, and the two ways ranks run on it.
//
// The ranks of run_ranks are forked from the test process, and a process cannot use CUDA after
// forking from one that initialized it; so the GPU is counted in a forked probe, never in the
// test process itself.
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "dtensor/comm/process_group.h"
#include "support/distributed.h"

namespace dtensor::testing {

// Number of CUDA devices LibTorch sees (0 for a CPU-only LibTorch), counted in a child process.
inline int cuda_device_count() {
  static const int count = [] {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int n = 0;
      try {
        n = at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
      } catch (...) {
        n = 0;
      }
      ::_exit(n > 100 ? 100 : n);
    }
    int status = 0;
    if (pid < 0 || ::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
    return WEXITSTATUS(status);
  }();
  return count;
}

// How ranks share the GPU: one rank over NCCL, or two ranks on the one GPU over Gloo
// (DTENSOR_CUDA_BACKEND=gloo; NCCL refuses two ranks on one device: "Duplicate GPU detected"),
// each compared with one device.
struct CudaSetting {
  std::string name;
  int world_size;
  std::string cuda_backend;  // DTENSOR_CUDA_BACKEND of the ranks
};

inline std::vector<CudaSetting> cuda_settings() {
  return {{"1 rank, NCCL", 1, "nccl"}, {"2 ranks sharing the GPU, Gloo", 2, "gloo"}};
}

// run_ranks for `s`: each rank joins with s.cuda_backend for its CUDA tensors, then runs body.
inline void run_cuda_ranks(const CudaSetting& s, const std::function<void(int)>& body) {
  SCOPED_TRACE(s.name);
  run_ranks(
      s.world_size,
      [&](int rank) {
        ::setenv("DTENSOR_CUDA_BACKEND", s.cuda_backend.c_str(), 1);  // this rank's process only
        comm::init_process_group();
        body(rank);
      },
      {.timeout = std::chrono::seconds(300),
       .comm_timeout = std::chrono::seconds(120),
       .init_process_group = false});
}

}  // namespace dtensor::testing

// First statement of every CUDA test.
#define SKIP_WITHOUT_CUDA()                                                             \
  do {                                                                                  \
    if (::dtensor::testing::cuda_device_count() == 0)                                   \
      GTEST_SKIP() << "no CUDA device visible (a CPU-only LibTorch, or no GPU on this " \
                      "machine); scripts/gpu-check runs these tests on a GPU machine";  \
  } while (0)
