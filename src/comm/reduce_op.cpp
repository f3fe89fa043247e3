#include "dtensor/comm/reduce_op.h"

#include <iterator>

namespace dtensor {

const char* reduce_op_name(ReduceOp op) {
  // Indexed by ReduceOp, in its declaration order.
  static constexpr const char* kNames[] = {"sum", "avg", "max", "min", "product"};
  static_assert(std::size(kNames) == static_cast<size_t>(ReduceOp::Product) + 1);
  const auto i = static_cast<size_t>(op);
  return i < std::size(kNames) ? kNames[i] : "?";
}

}  // namespace dtensor
