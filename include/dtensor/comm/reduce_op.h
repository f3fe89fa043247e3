#pragma once
// How a collective combines the ranks' values. It belongs to comm (the collectives take it);
// core's Partial placements carry one.
#include <cstdint>

namespace dtensor {

/// The reduction a collective applies: all_reduce, reduce_scatter and Partial placements.
enum class ReduceOp : uint8_t { Sum, Avg, Max, Min, Product };

/// "sum", "avg", "max", "min" or "product".
const char* reduce_op_name(ReduceOp op);

}  // namespace dtensor
