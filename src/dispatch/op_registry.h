#pragma once
// Per-operator facts the kernel needs, computed once per operator from its schema.
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

#include "dtensor/dispatch/op_call.h"

namespace dtensor::dispatch {

enum class ReturnKind : uint8_t { Tensor, TensorList, Other };

struct ContextRule {
  int64_t mask;
  Rule rule;
};

struct OpInfo {
  std::string name;  // "aten::add.Tensor"
  const Rule* rule = nullptr;
  const Decomposition* decomposition = nullptr;   // run by composite_kernel instead of LibTorch's
  std::vector<const ContextRule*> context_rules;  // checked first while their bits are set
  size_t num_args = 0;
  size_t num_returns = 0;
  // Arguments whose value is part of the cache key (ints, bools, int lists, strings, dtypes):
  // not Scalars/floats, whose values change from step to step (learning rates, step counts).
  std::vector<bool> static_arg;
  std::vector<ReturnKind> return_kind;
  std::vector<int> return_writes_arg;  // in-place / out=: the argument returned, else -1
  std::vector<bool> return_is_view;
};

// Looked up by operator; thread-local fast path over a shared table.
const OpInfo& op_info(const c10::OperatorHandle& op);
std::string qualified_name(const c10::OperatorHandle& op);

}  // namespace dtensor::dispatch
