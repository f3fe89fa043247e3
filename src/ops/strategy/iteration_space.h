#pragma once
// Strategies from an iteration space, the generator behind the tensor-manipulation and indexing
// rules (cat, slice, index, gather, scatter, roll, ...). Every logical dim of the op says which
// dim of each operand it runs over and which output dim it becomes (or that it is summed over).
// A mesh dim may then shard any logical dim whose operands agree on its size, carry a Partial
// through operands the op is linear in, or replicate; candidates are compared by the cost model.
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops::iteration {

// How a Partial may pass through the op.
enum class Lin {
  None,    // non-linear: Partial inputs are reduced first
  Select,  // the op only moves or drops elements: any Partial passes (if operands agree)
  Sum,     // the op adds operands (accumulates): Partial(sum|avg) only; summed dims allowed
};

// Operand::dims entries that are not a dim of the operand.
inline constexpr int64_t kAbsent = -1;     // the operand does not run over this logical dim
inline constexpr int64_t kBroadcast = -2;  // it does, broadcast (a missing leading dim)

struct Operand {
  size_t input = 0;           // index into OpCall::inputs()
  std::vector<int64_t> dims;  // per logical dim: the operand's dim, kAbsent or kBroadcast
  bool broadcast = false;     // a size-1 dim is broadcast (replicated) instead of a mismatch
  bool linear = false;        // Partial may pass through this operand
};

struct Space {
  std::vector<int64_t> size;    // per logical dim
  std::vector<int64_t> out;     // per logical dim: output dim, or -1 (summed over, or absent)
  std::vector<bool> shardable;  // per logical dim
  std::vector<Operand> operands;
  std::vector<bool> as_is;  // per input: left as it is (legacy empty cat inputs)
  Lin lin = Lin::None;
  int inplace = -1;  // input written in place: it must keep its placements

  explicit Space(size_t ninputs) : as_is(ninputs, false) {}
  void add_dim(int64_t sz, int64_t out_dim, bool can_shard) {
    size.push_back(sz);
    out.push_back(out_dim);
    shardable.push_back(can_shard);
    for (auto& o : operands) o.dims.push_back(kAbsent);
  }
  Operand& operand(size_t input, bool linear, bool broadcast = false) {
    operands.push_back(
        Operand{input, std::vector<int64_t>(size.size(), kAbsent), broadcast, linear});
    return operands.back();
  }
};

// The cheapest strategy of the space; the output metadata too for ops without a meta kernel.
Decision decide(const OpCall& call, const Space& s);

std::vector<int64_t> iota(int64_t n);

// One operand over the first logical dims, in order, except `skip` dims.
Operand& identity_operand(Space& s, size_t input, int64_t ndim, bool linear,
                          std::initializer_list<int64_t> skip = {});

// A space over `shape` with the same output dims, all shardable except `fixed`.
Space same_shape_space(const OpCall& call, c10::IntArrayRef shape,
                       const std::vector<int64_t>& fixed);

// Logical dims = the input's dims; output dims skip `dim` (select, unbind). Lin::Select.
Space dropping_dim_space(const OpCall& call, const DTensorSpec& in, int64_t dim);

}  // namespace dtensor::ops::iteration
