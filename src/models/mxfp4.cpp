// MXFP4 dequantisation (mxfp4.h).
#include "dtensor/models/mxfp4.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace dtensor::models {

at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales,
                            c10::ScalarType dtype, const std::string& what) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, what,
              ": MXFP4 blocks and scales must be uint8, got ", blocks.scalar_type(), " and ",
              scales.scalar_type());
  const bool fits = blocks.dim() >= 2 && blocks.size(-1) == 16 &&
                    blocks.sizes().slice(0, blocks.dim() - 1) == scales.sizes();
  TORCH_CHECK(fits, what, ": MXFP4 scales ", scales.sizes(), " do not match blocks ",
              blocks.sizes(),
              " (blocks are [..., rows, groups, 16] bytes and scales "
              "[..., rows, groups], one per 32 values)");
  // E2M1: sign, two exponent bits, one mantissa bit.
  static const at::Tensor kValues =
      at::tensor({+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f, -0.0f, -0.5f, -1.0f,
                  -1.5f, -2.0f, -3.0f, -4.0f, -6.0f});
  const at::Tensor bytes = blocks.to(at::kLong);
  const at::Tensor values = at::stack({kValues.index({bytes.bitwise_and(0x0F)}),
                                       kValues.index({bytes.bitwise_right_shift(4)})},
                                      -1)
                                .flatten(-3);  // [..., rows, G * 32]: groups of 32 in order
  const at::Tensor exponent = (scales.to(at::kInt) - 127).repeat_interleave(32, -1);
  return at::ldexp(values, exponent.to(at::kFloat)).to(dtype);
}

}  // namespace dtensor::models
