#pragma once
// Property checks for sharding rules: an op run on DTensors laid out as given must produce
// what plain LibTorch produces on one device, forward and backward.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "dtensor/dtensor.h"

namespace dtensor::testing {

using OpFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

struct OpCheckOptions {
  bool backward = true;  // also compare the gradients of every floating input
  double rtol = 1e-10;
  double atol = 1e-10;
  std::vector<bool> requires_grad;  // per input; default: every floating input
  // Also compare the sizes and strides of every DTensor output and gradient with the plain
  // result's (strides of dims with one element are not compared: any value is valid there).
  bool layout = true;
  // Backward from the plain sum of the outputs instead of the weighted one: each output's
  // gradient is then a broadcast of ones (every stride 0), as `loss.sum().backward()` gives.
  bool sum_loss = false;
};

// Whether `actual` has `expected`'s sizes and, on dims of more than one element, its strides.
::testing::AssertionResult same_layout(const at::Tensor& actual, const at::Tensor& expected);

// Whether `grad`, the gradient of `leaf`, is a DTensor on the leaf's mesh when the leaf is a
// DTensor (undefined gradients and plain leaves pass), also where the derivative formula builds
// it as a plain tensor (cat's zeros for a legacy empty [0] operand).
::testing::AssertionResult grad_on_leaf_mesh(const at::Tensor& grad, const at::Tensor& leaf);

// Distributes `inputs` (global tensors, identical on every rank) with `placements` (a Partial
// input holds value/n per rank), runs `fn` on them and on the plain tensors, and compares
// full_tensor() of every output and, with backward, every input gradient of
// sum_i <out_i, w_i> for fixed random weights w_i (each a DTensor on the input's mesh), or of
// sum_i sum(out_i) with `sum_loss`. Returns
// false (and records gtest failures) on any mismatch. `label` names the case in failures.
bool check_op(const DeviceMesh& mesh, const std::string& label, const OpFn& fn,
              const std::vector<at::Tensor>& inputs, const std::vector<Placements>& placements,
              const OpCheckOptions& options = {});

// Placements of a tensor with `ndim` dims on a 1-D mesh: R, S(0), ..., S(ndim-1) [, P].
std::vector<Placements> placements_1d(int64_t ndim, bool with_partial = false);
// Every combination of per-input choices.
std::vector<std::vector<Placements>> combinations(
    const std::vector<std::vector<Placements>>& per_input);

// Counts (op, case) combinations a test ran.
struct SweepCounter {
  int64_t cases = 0;
  int64_t failures = 0;
  void add(bool ok) {
    ++cases;
    failures += ok ? 0 : 1;
  }
  // On every rank: the sweep compared exactly `expected` cases, a number the caller works out
  // from its loops, so a generator that yields fewer cases (or none) fails instead of passing
  // on an empty sweep. Rank 0 prints "[sweep] <what>: <cases> (op, case) combinations".
  void expect_cases(int64_t expected, int rank, const std::string& what) const;
};

}  // namespace dtensor::testing
