// ContextParallelScope: see include/dtensor/cp/context_parallel.h.
#include "dtensor/cp/context_parallel.h"

#include <c10/util/Exception.h>

#include <utility>

namespace dtensor::cp {
namespace {
thread_local const ContextParallel* current_context = nullptr;
}  // namespace

int64_t ContextParallel::rank() const { return group->rank(); }

at::Tensor ContextParallel::local_positions() const {
  const int64_t n = layout.local_len();
  return layout.positions().narrow(1, rank() * n, n);
}

ContextParallelScope::ContextParallelScope(ContextParallel context)
    : context_(std::move(context)), previous_(current_context) {
  TORCH_CHECK(context_.group, "ContextParallelScope: no cp process group");
  TORCH_CHECK(context_.group->size() == context_.layout.cp_size(),
              "ContextParallelScope: the cp group ", context_.group->name(), " has ",
              context_.group->size(),
              " ranks but the layout splits over cp = ", context_.layout.cp_size());
  current_context = &context_;
}

ContextParallelScope::~ContextParallelScope() { current_context = previous_; }

const ContextParallel* ContextParallelScope::current() { return current_context; }

}  // namespace dtensor::cp
