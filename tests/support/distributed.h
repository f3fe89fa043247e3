#pragma once
// Multi-process test harness: run_ranks(n, body) forks n ranks, each joins a fresh process
// group over loopback (through the same environment variables torchrun sets) and runs `body`.
// The test fails with the failing rank's message; a hang fails after the timeout.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>

namespace dtensor::testing {

struct RunOptions {
  std::chrono::seconds timeout{120};      // whole run
  std::chrono::seconds comm_timeout{30};  // c10d timeout inside the ranks
  // Bound on joining and on a group's first collective (DTENSOR_CONNECT_TIMEOUT_S); unset: the
  // library's default.
  std::optional<std::chrono::seconds> connect_timeout;
  bool init_process_group = true;  // false: body joins by itself
};

// Runs `body(rank)` on `world_size` forked ranks. Returns when all ranks exit.
void run_ranks(int world_size, const std::function<void(int rank)>& body,
               const RunOptions& options = {});

// Expects two tensors to be equal within tolerances, with a readable message.
::testing::AssertionResult tensors_close(const at::Tensor& actual, const at::Tensor& expected,
                                         double rtol = 1e-6, double atol = 1e-7);

}  // namespace dtensor::testing

#define EXPECT_TENSOR_CLOSE(a, b, ...) \
  EXPECT_TRUE(::dtensor::testing::tensors_close((a), (b), ##__VA_ARGS__))
#define EXPECT_TENSOR_EQ(a, b) EXPECT_TRUE(::dtensor::testing::tensors_close((a), (b), 0.0, 0.0))
