#pragma once
// How a tensor is laid out along one mesh dimension: Shard(dim), Replicate, or Partial(op).
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "dtensor/comm/reduce_op.h"

namespace dtensor {

/// One mesh dim's layout: Replicate, Shard(dim) or Partial(op) (PyTorch's Placement types).
class Placement {
 public:
  /// Which kind of placement.
  enum class Type : uint8_t { Replicate, Shard, Partial };

  constexpr Placement() = default;  // Replicate
  /// Replicate: every rank holds the whole tensor.
  static constexpr Placement replicate() { return Placement(); }
  /// Shard(dim): tensor dim `dim` is split across the mesh dim (torch.chunk rule).
  static constexpr Placement shard(int64_t dim) {
    return Placement(Type::Shard, dim, ReduceOp::Sum);
  }
  /// Partial(op): each rank holds a part; the value is their reduction by `op`.
  static constexpr Placement partial(ReduceOp op = ReduceOp::Sum) {
    return Placement(Type::Partial, 0, op);
  }
  /// Pending p-norm: ranks hold norms of their parts; the value is (sum |x_r|^p)^(1/p)
  /// (max for p = inf, min for p = -inf). Produced by norm reductions (gradient clipping).
  static Placement norm_partial(double p);

  Type type() const { return type_; }                             ///< The kind.
  bool is_replicate() const { return type_ == Type::Replicate; }  ///< Whether Replicate.
  bool is_shard() const { return type_ == Type::Shard; }          ///< Whether Shard (any dim).
  /// Whether Shard(dim).
  bool is_shard(int64_t dim) const { return type_ == Type::Shard && dim_ == dim; }
  /// Whether Partial (norm partials included).
  bool is_partial() const { return type_ == Type::Partial; }
  /// Shard dimension; only meaningful for is_shard().
  int64_t dim() const { return dim_; }
  ReduceOp reduce_op() const { return op_; }  ///< The reduction of a Partial (Sum for the others).
  /// The p of a norm partial; 0 for an ordinary Partial.
  double norm_p() const { return norm_p_; }
  /// Partial with a p-norm reduction.
  bool is_norm_partial() const { return type_ == Type::Partial && norm_p_ != 0.0; }

  /// Shard(d) with d < 0 becomes Shard(d + ndim); others are returned unchanged.
  Placement normalized(int64_t ndim) const;

  /// Same kind and, where they matter, same dim or reduction.
  bool operator==(const Placement& o) const {
    return type_ == o.type_ && (type_ != Type::Shard || dim_ == o.dim_) &&
           (type_ != Type::Partial || (op_ == o.op_ && norm_p_ == o.norm_p_));
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }  ///< Negation of ==.
  /// Hash consistent with ==.
  size_t hash() const {
    return (static_cast<size_t>(type_) << 40) ^
           (is_shard() ? static_cast<size_t>(dim_ + 1024) : 0) ^
           (is_partial() ? (static_cast<size_t>(op_) << 20) ^ std::hash<double>{}(norm_p_) : 0);
  }

  /// Short form as PyTorch prints it: S(0), R, P(sum).
  std::string str() const;
  /// Long form: Shard(dim=0), Replicate(), Partial(sum).
  std::string repr() const;

 private:
  constexpr Placement(Type t, int64_t dim, ReduceOp op) : type_(t), op_(op), dim_(dim) {}
  Type type_ = Type::Replicate;
  ReduceOp op_ = ReduceOp::Sum;
  int64_t dim_ = 0;
  double norm_p_ = 0.0;
};

/// PyTorch-style spellings: {Shard(0), Replicate()}, Partial(), Partial(ReduceOp::Max).
inline constexpr Placement Shard(int64_t dim) { return Placement::shard(dim); }
inline constexpr Placement Replicate() { return Placement::replicate(); }
inline constexpr Placement Partial(ReduceOp op = ReduceOp::Sum) { return Placement::partial(op); }

/// Placements of a DTensor, one per mesh dim.
using Placements = c10::SmallVector<Placement, 4>;

std::string to_string(c10::ArrayRef<Placement> placements);  // "(S(0), R)"

/// n Replicate placements.
inline Placements replicate_all(int64_t n) {
  return Placements(static_cast<size_t>(n), Placement());
}
/// `p` with every Partial replaced by Replicate.
inline Placements clear_partial(c10::ArrayRef<Placement> p) {
  Placements out;
  for (const auto& x : p) out.push_back(x.is_partial() ? Placement() : x);
  return out;
}
/// Prints str(), e.g. S(0).
std::ostream& operator<<(std::ostream& os, const Placement& p);
/// Prints to_string(p), e.g. (S(0), R).
std::ostream& operator<<(std::ostream& os, c10::ArrayRef<Placement> p);

}  // namespace dtensor

template <>
/// Hashes a Placement with Placement::hash().
struct std::hash<dtensor::Placement> {
  size_t operator()(const dtensor::Placement& p) const noexcept { return p.hash(); }
};
