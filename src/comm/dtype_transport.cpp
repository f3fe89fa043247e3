#include "dtype_transport.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/view_as_real.h>
#include <c10/util/Exception.h>

namespace dtensor::comm::detail {
namespace {

// The dtypes Gloo (c10d's ProcessGroupGloo: float, double, half, bfloat16, int8, uint8, bool,
// int32, int64), NCCL and our MPI backend all move and reduce.
bool every_engine_carries(c10::ScalarType s) {
  switch (s) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kBool:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

bool is_float8(c10::ScalarType s) {
  return s == at::kFloat8_e5m2 || s == at::kFloat8_e4m3fn || s == at::kFloat8_e5m2fnuz ||
         s == at::kFloat8_e4m3fnuz || s == at::kFloat8_e8m0fnu;
}

[[noreturn]] void refuse(const char* collective, ReduceOp op, c10::ScalarType s, const char* why) {
  TORCH_CHECK(false, "dtensor: ", collective, " cannot reduce ", c10::toString(s), " tensors by ",
              reduce_op_name(op), ": ", why, " (refused on every rank before communicating)");
}

}  // namespace

at::Tensor dense(const at::Tensor& t) {
  at::Tensor r = t.is_conj() || t.is_neg() ? t.resolve_conj().resolve_neg() : t;
  return r.is_contiguous() ? r : r.contiguous();
}

at::Tensor movable(const at::Tensor& t) {
  if (every_engine_carries(t.scalar_type())) return t;
  TORCH_CHECK(!t.is_quantized(), "dtensor: collectives do not move quantized tensors (",
              c10::toString(t.scalar_type()), "); dequantize first");
  return t.reshape({-1}).view(at::kByte);
}

Reduction::Reduction(c10::ScalarType s, ReduceOp op, const char* collective) : engine_op_(op) {
  const bool integral = c10::isIntegralType(s, /*includeBool=*/true);
  if (op == ReduceOp::Avg && integral) {
    refuse(collective, op, s, "an average of integers or booleans is not one of them");
  }
  if (every_engine_carries(s) && s != at::kBool) return;
  if (s == at::kBool) {
    // Engines add booleans as bytes (1 + 1 = 2 is no bool): a sum is "any", a product "all".
    carrier_ = Carrier::Reinterpret;
    wide_ = at::kByte;
    if (op == ReduceOp::Sum) engine_op_ = ReduceOp::Max;
    if (op == ReduceOp::Product) engine_op_ = ReduceOp::Min;
  } else if (c10::isComplexType(s)) {
    // Sums of complex numbers are sums of their real pairs; complex numbers have no order, and
    // a complex product mixes the pairs.
    if (op != ReduceOp::Sum && op != ReduceOp::Avg) {
      refuse(collective, op, s, "complex numbers are reduced by sum or avg only");
    }
    carrier_ = Carrier::RealView;
  } else if (s == at::kShort || s == at::kUInt16 || s == at::kUInt32) {
    // Exact in int64: sums and products wrap to the same low bits as in the dtype itself.
    carrier_ = Carrier::Widened;
    wide_ = at::kLong;
  } else if (s == at::kUInt64) {
    if (op == ReduceOp::Max || op == ReduceOp::Min) {
      refuse(collective, op, s, "no engine orders unsigned 64-bit integers");
    }
    // Two's-complement sums and products of the same bits wrap alike.
    carrier_ = Carrier::Reinterpret;
    wide_ = at::kLong;
  } else if (is_float8(s)) {
    carrier_ = Carrier::Widened;
    wide_ = at::kFloat;
  } else {
    refuse(collective, op, s, "the dtype has no arithmetic the engines know");
  }
}

at::Tensor Reduction::to_engine(const at::Tensor& t) const {
  switch (carrier_) {
    case Carrier::Native:
      return t;
    case Carrier::RealView:
      return at::view_as_real(t);
    case Carrier::Reinterpret:
      return t.view(wide_);
    case Carrier::Widened:
      return t.to(wide_);
  }
  return t;
}

at::Tensor Reduction::engine_output(const at::Tensor& out) const {
  if (carrier_ == Carrier::Widened) return at::empty(out.sizes(), out.options().dtype(wide_));
  return to_engine(out);
}

at::Tensor Reduction::from_engine(const at::Tensor& engine, const at::Tensor& out) const {
  if (carrier_ == Carrier::Widened) out.copy_(engine);
  return out;
}

}  // namespace dtensor::comm::detail
