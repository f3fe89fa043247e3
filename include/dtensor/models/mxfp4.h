#pragma once
// MXFP4 weights as published gpt-oss checkpoints store their experts (the OCP microscaling
// format): blocks of 32 values sharing one power-of-two scale, each value a 4-bit E2M1 number.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace dtensor::models {

/// The values of MXFP4 `blocks` (uint8 [..., rows, G, 16]: two E2M1 numbers per byte, the even
/// element in the low nibble) scaled by 2^(scales - 127) (`scales` uint8 [..., rows, G], one per
/// 32 values), as [..., rows, G * 32] in `dtype`. Every MXFP4 value times a power of two is exact
/// in float32 and bfloat16, so the result is transformers' dequantisation bit for bit. Throws
/// naming `what` (the file and the tensor) and both shapes when the scales do not match the
/// blocks, or naming the dtype when either is not uint8.
at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales,
                            c10::ScalarType dtype, const std::string& what);

}  // namespace dtensor::models
