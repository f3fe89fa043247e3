#include "dtensor/comm/reduce_op.h"

namespace dtensor {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Product:
      return "product";
  }
  return "?";
}

}  // namespace dtensor
