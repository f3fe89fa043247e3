#include "dtensor/core/placement.h"

#include <c10/util/StringUtil.h>

#include <cmath>

namespace dtensor {

Placement Placement::norm_partial(double p) {
  const ReduceOp op = std::isinf(p) ? (p > 0 ? ReduceOp::Max : ReduceOp::Min) : ReduceOp::Sum;
  Placement out(Type::Partial, 0, op);
  out.norm_p_ = p;
  return out;
}

Placement Placement::normalized(int64_t ndim) const {
  if (is_shard() && dim_ < 0) return Placement::shard(dim_ + ndim);
  return *this;
}

std::string Placement::str() const {
  switch (type_) {
    case Type::Replicate:
      return "R";
    case Type::Shard:
      return "S(" + std::to_string(dim_) + ")";
    case Type::Partial:
      if (norm_p_ != 0.0) return "P(norm" + c10::str(norm_p_) + ")";
      return std::string("P(") + reduce_op_name(op_) + ")";
  }
  return "?";
}

std::string Placement::repr() const {
  switch (type_) {
    case Type::Replicate:
      return "Replicate()";
    case Type::Shard:
      return "Shard(dim=" + std::to_string(dim_) + ")";
    case Type::Partial:
      if (norm_p_ != 0.0) return "NormPartial(p=" + c10::str(norm_p_) + ")";
      return std::string("Partial(") + reduce_op_name(op_) + ")";
  }
  return "?";
}

std::string to_string(c10::ArrayRef<Placement> placements) {
  std::string s;
  for (size_t i = 0; i < placements.size(); ++i) s += (i ? ", " : "") + placements[i].str();
  return "(" + s + ")";
}

std::ostream& operator<<(std::ostream& os, const Placement& p) { return os << p.str(); }
std::ostream& operator<<(std::ostream& os, c10::ArrayRef<Placement> p) {
  return os << to_string(p);
}

}  // namespace dtensor
