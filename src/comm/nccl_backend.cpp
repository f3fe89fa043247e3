// NCCL backend for CUDA tensors; compiled with USE_C10D_NCCL only when LibTorch has CUDA.
#include "backends.h"

#ifdef DTENSOR_WITH_NCCL
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace dtensor::comm::detail {

bool has_nccl() {
#ifdef DTENSOR_WITH_NCCL
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
#ifdef DTENSOR_WITH_NCCL
  auto opts = c10::make_intrusive<c10d::ProcessGroupNCCL::Options>();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  return {};
#endif
}

}  // namespace dtensor::comm::detail
