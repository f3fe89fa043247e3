#pragma once
// How a tensor of any dtype LibTorch has travels over any engine (docs/BACKENDS.md, "Dtypes").
// The engines carry different dtype sets (Gloo neither int16 nor complex, MPI no half types,
// NCCL no complex): the collectives hand every engine only dtypes all of them carry, moving the
// others as their bytes and reducing them as real views or in a wider dtype. What no engine can
// reduce is refused before the collective starts; the dtype and the op are the same on every
// rank, so every rank refuses alike and no peer is left waiting.
#include <ATen/core/Tensor.h>

#include "dtensor/comm/reduce_op.h"

namespace dtensor::comm::detail {

// A dense tensor with the same values as `t` and no lazy conjugate or negative bit, which an
// engine copying the memory would lose: `t` itself when it already is one.
at::Tensor dense(const at::Tensor& t);

// For a moving collective (gather, all-to-all, broadcast, scatter, point-to-point): what the
// engine gets for the dense buffer `t`, aliasing it: `t` when every engine carries its dtype,
// else its bytes as a flat uint8 view.
at::Tensor movable(const at::Tensor& t);

// How a reduction runs on the engine for one dtype and op.
class Reduction {
 public:
  // Refuses, naming `collective`, what cannot be reduced: max, min and product of complex
  // numbers (PyTorch refuses them too), an average of integers or booleans, and dtypes without
  // arithmetic (quantized, bits, packed float4).
  Reduction(c10::ScalarType dtype, ReduceOp op, const char* collective);

  // True when the engine reduces the tensor itself, in its own dtype and op.
  bool native() const { return carrier_ == Carrier::Native; }
  // The op the engine applies (booleans: or as max, and as min).
  ReduceOp engine_op() const { return engine_op_; }
  // What the engine reduces for the dense buffer `t`: a view of it (complex as real pairs,
  // booleans as bytes, uint64 as int64) or a copy in a wider dtype (int16, uint16 and uint32 as
  // int64, float8 as float32).
  at::Tensor to_engine(const at::Tensor& t) const;
  // Where the engine writes a result meant for `out`: a view of it, or a fresh wider tensor.
  at::Tensor engine_output(const at::Tensor& out) const;
  // `out` (a tensor of the original dtype) holding the reduced `engine` values: `out` itself
  // when `engine` is a view of it, else `out` after a copy back.
  at::Tensor from_engine(const at::Tensor& engine, const at::Tensor& out) const;

 private:
  enum class Carrier : uint8_t { Native, RealView, Reinterpret, Widened };
  Carrier carrier_ = Carrier::Native;
  c10::ScalarType wide_ = c10::ScalarType::Undefined;
  ReduceOp engine_op_;
};

}  // namespace dtensor::comm::detail
