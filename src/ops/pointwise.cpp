// Element-wise ops with broadcasting: follow the input with the most shards; Partial survives only
// through linear ops and scalar shifts (docs/ARCHITECTURE.md, "Pointwise").
#include <ATen/TensorIterator.h>
#include <ATen/ops/empty_strided.h>

#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

// Shift: a scalar added or subtracted. mean, max and min commute with it (mean(x) + c =
// mean(x + c)), a sum does not; so P(avg), P(max) and P(min) survive. CUDA's composite
// rms_norm adds eps in place to the mean of squares, P(avg) when the normalized dim is sharded.
enum class Linearity { None, Unary, Additive, Multiplicative, Shift };

// Whether a Partial input stays Partial through an op of this linearity.
bool survives(const Placement& p, Linearity lin) {
  if (!p.is_partial() || p.is_norm_partial() || lin == Linearity::None) return false;
  const ReduceOp op = p.reduce_op();
  if (lin == Linearity::Shift)
    return op == ReduceOp::Avg || op == ReduceOp::Max || op == ReduceOp::Min;
  return op == ReduceOp::Sum || op == ReduceOp::Avg;
}

// Fresh: a new result. InPlace: written into input 0 (`self`). Out: written into the `out=`
// argument, which takes no part in broadcasting (it may be resized) but fixes the layout.
enum class Write { Fresh, InPlace, Out };

// Index in call.inputs() of the schema's written keyword argument (`Tensor(a!) out`).
size_t out_input(const OpCall& call) {
  const auto& args = call.schema().arguments();
  for (size_t a = 0; a < args.size(); ++a) {
    const auto* alias = args[a].alias_info();
    if (args[a].kwarg_only() && alias != nullptr && alias->isWrite()) {
      const int i = input_of(call, static_cast<int>(a));
      TORCH_CHECK(i >= 0, call.name(), ": the out= tensor is missing");
      return static_cast<size_t>(i);
    }
  }
  TORCH_CHECK(false, call.name(), ": registered as an out= variant but has no out argument");
}

// The broadcast shape of the operands (all inputs but `skip`) and the strides an element-wise
// result gets from them, as TensorIterator decides both on the global shapes: incompatible
// shapes are refused here, the same on every rank, and a result of permuted inputs is
// permuted like theirs (a transposed operand gives a transposed result, as on one device).
TensorMeta broadcast_layout(const OpCall& call, size_t skip) {
  // Dtypes do not change shapes or layouts: one float dtype for all keeps TensorIterator's
  // type checks out of it (the result dtype is found elsewhere).
  at::TensorIteratorConfig config;
  config.add_owned_output(at::Tensor());
  for (size_t j = 0; j < call.num_inputs(); ++j) {
    if (j == skip) continue;
    const auto& in = call.input(j);
    config.add_owned_const_input(at::empty_strided(
        in.shape(), in.stride(), at::TensorOptions().dtype(at::kFloat).device(c10::kMeta)));
  }
  at::TensorIterator iter;
  try {
    iter = config.build();
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, call.name(), ": the global shapes of its inputs ",
                      call.placements_str(), " do not broadcast: ", e.msg());
  }
  const at::Tensor& out = iter.output(0);
  return TensorMeta{out.sizes().vec(), out.strides().vec(), at::kFloat};
}

Decision pointwise(const OpCall& call, Linearity lin, Write write) {
  const size_t n = call.num_inputs();
  TORCH_CHECK(n > 0, call.name(), ": pointwise rule without tensor inputs");
  const bool inplace = write != Write::Fresh;
  const size_t written = write == Write::Out ? out_input(call) : 0;
  // Broadcast output shape and layout (of the operands: an out= tensor's does not count).
  const TensorMeta layout = broadcast_layout(call, write == Write::Out ? written : n);
  const std::vector<int64_t>& out_shape = layout.shape;
  const int64_t out_nd = static_cast<int64_t>(out_shape.size());
  // Follow the most-sharded input; on equal shard counts (a 1-rank mesh) a Shard placement
  // still beats Replicate/Partial, then more dims, then the earliest.
  auto shard_dims = [](const DTensorSpec& s) {
    int64_t n = 0;
    for (const auto& p : s.placements()) n += p.is_shard() ? 1 : 0;
    return n;
  };
  // The written tensor cannot change layout: in-place and out= ops follow it.
  size_t follow = written;
  if (!inplace) {
    for (size_t j = 1; j < n; ++j) {
      const auto& a = call.input(j);
      const auto& b = call.input(follow);
      const auto ka = std::make_tuple(a.num_shards(), shard_dims(a), a.ndim());
      const auto kb = std::make_tuple(b.num_shards(), shard_dims(b), b.ndim());
      if (ka > kb) follow = j;
    }
  }
  const DTensorSpec& f = call.input(follow);
  Placements out;
  for (const auto& p : f.placements()) {
    if (p.is_shard()) {
      out.push_back(Shard(p.dim() + out_nd - f.ndim()));
    } else if (survives(p, lin)) {
      out.push_back(p);
    } else {
      out.push_back(Replicate());
    }
  }
  // A Partial output needs every Partial-target input to be reducible: a shard is not.
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].is_partial()) continue;
    for (size_t j = 0; j < n; ++j) {
      if (call.input(j).placements()[i].is_shard()) out[i] = Replicate();
    }
  }
  std::vector<Placements> inputs;
  for (size_t j = 0; j < n; ++j) {
    const auto& in = call.input(j);
    if (write == Write::Out && j == written) {
      inputs.push_back(out);  // it receives the result: the output's layout
      continue;
    }
    const int64_t off = out_nd - in.ndim();
    Placements tp;
    for (const auto& o : out) {
      if (o.is_shard()) {
        const int64_t d = o.dim() - off;
        const bool broadcast = d < 0 || (in.shape()[d] == 1 && out_shape[o.dim()] != 1);
        tp.push_back(broadcast ? Replicate() : Shard(d));
      } else if (o.is_partial()) {
        const bool partial = lin == Linearity::Additive || lin == Linearity::Unary ||
                             lin == Linearity::Shift ||
                             (lin == Linearity::Multiplicative && j == follow);
        tp.push_back(partial ? o : Replicate());
      } else {
        tp.push_back(Replicate());
      }
    }
    inputs.push_back(std::move(tp));
  }
  Decision d = all_outputs(call, std::move(inputs), out);
  // Many element-wise kernels have no meta implementation: give the output metadata here.
  const at::ScalarType dtype = inplace ? call.input(written).dtype() : proxy_result_dtype(call);
  d.output_meta.push_back(
      TensorMeta{out_shape, inplace ? call.input(written).stride() : layout.stride, dtype});
  return d;
}

void reg(std::initializer_list<const char*> names, Linearity lin, Write write = Write::Fresh) {
  for (const char* name : names) {
    dispatch::register_rule(name,
                            [lin, write](const OpCall& c) { return pointwise(c, lin, write); });
  }
}

}  // namespace

DTENSOR_RULES(pointwise) {
  using L = Linearity;
  reg({"aten::add.Tensor", "aten::sub.Tensor"}, L::Additive);
  reg({"aten::add_.Tensor", "aten::sub_.Tensor"}, L::Additive, Write::InPlace);
  reg({"aten::mul.Tensor"}, L::Multiplicative);
  reg({"aten::mul_.Tensor"}, L::Multiplicative, Write::InPlace);
  reg({"aten::mul.Scalar", "aten::div.Scalar", "aten::neg", "aten::_conj", "aten::positive"},
      L::Unary);
  reg({"aten::mul_.Scalar", "aten::div_.Scalar", "aten::neg_"}, L::Unary, Write::InPlace);
  reg({"aten::div.Tensor",
       "aten::div.Tensor_mode",
       "aten::div.Scalar_mode",
       "aten::rsub.Tensor",
       "aten::rsub.Scalar",
       "aten::pow.Tensor_Scalar",
       "aten::pow.Tensor_Tensor",
       "aten::pow.Scalar",
       "aten::abs",
       "aten::exp",
       "aten::exp2",
       "aten::expm1",
       "aten::log",
       "aten::log1p",
       "aten::log2",
       "aten::log10",
       "aten::sqrt",
       "aten::rsqrt",
       "aten::sin",
       "aten::cos",
       "aten::tan",
       "aten::tanh",
       "aten::sigmoid",
       "aten::relu",
       "aten::gelu",
       "aten::silu",
       "aten::erf",
       "aten::erfinv",
       "aten::reciprocal",
       "aten::sign",
       "aten::sgn",
       "aten::floor",
       "aten::ceil",
       "aten::round",
       "aten::trunc",
       "aten::frac",
       "aten::square",
       "aten::logical_not",
       "aten::bitwise_not",
       "aten::isnan",
       "aten::isinf",
       "aten::isfinite",
       "aten::nan_to_num",
       "aten::clamp",
       "aten::clamp.Tensor",
       "aten::clamp_min",
       "aten::clamp_max",
       "aten::clamp_min.Tensor",
       "aten::clamp_max.Tensor",
       "aten::hardtanh",
       "aten::leaky_relu",
       "aten::elu",
       "aten::softplus",
       "aten::mish",
       "aten::maximum",
       "aten::minimum",
       "aten::fmax",
       "aten::fmin",
       "aten::atan2",
       "aten::eq.Tensor",
       "aten::ne.Tensor",
       "aten::lt.Tensor",
       "aten::le.Tensor",
       "aten::gt.Tensor",
       "aten::ge.Tensor",
       "aten::eq.Scalar",
       "aten::ne.Scalar",
       "aten::lt.Scalar",
       "aten::le.Scalar",
       "aten::gt.Scalar",
       "aten::ge.Scalar",
       "aten::logical_and",
       "aten::logical_or",
       "aten::logical_xor",
       "aten::bitwise_and.Tensor",
       "aten::bitwise_or.Tensor",
       "aten::bitwise_xor.Tensor",
       "aten::where.self",
       "aten::masked_fill.Scalar",
       "aten::masked_fill.Tensor",
       "aten::lerp.Scalar",
       "aten::lerp.Tensor",
       "aten::addcmul",
       "aten::addcdiv",
       "aten::fmod.Scalar",
       "aten::fmod.Tensor",
       "aten::remainder.Scalar",
       "aten::remainder.Tensor",
       "aten::floor_divide",
       "aten::xlogy.Tensor",
       "aten::threshold",
       "aten::threshold_backward",
       "aten::gelu_backward",
       "aten::silu_backward",
       "aten::sigmoid_backward",
       "aten::tanh_backward",
       "aten::native_dropout_backward",
       "aten::hardtanh_backward",
       "aten::leaky_relu_backward",
       "aten::elu_backward",
       "aten::softplus_backward",
       "aten::mish_backward",
       "aten::logit_backward",
       "aten::hardsigmoid_backward",
       "aten::hardswish_backward",
       "aten::copysign.Tensor",
       "aten::hypot",
       "aten::logaddexp",
       "aten::sinh",
       "aten::cosh",
       "aten::asin",
       "aten::acos",
       "aten::atan",
       "aten::asinh",
       "aten::acosh",
       "aten::atanh",
       "aten::lgamma",
       "aten::digamma",
       "aten::sinc",
       "aten::logit",
       "aten::relu6",
       "aten::hardsigmoid",
       "aten::hardswish",
       "aten::angle",
       "aten::deg2rad",
       "aten::rad2deg",
       "aten::erfc",
       "aten::i0",
       "aten::igamma",
       "aten::igammac",
       "aten::isneginf",
       "aten::isposinf",
       "aten::signbit",
       "aten::ldexp.Tensor",
       "aten::logaddexp2",
       "aten::mvlgamma",
       "aten::nextafter",
       "aten::polygamma",
       "aten::special_polygamma",
       "aten::round.decimals",
       "aten::heaviside",
       "aten::float_power.Tensor_Scalar",
       "aten::float_power.Tensor_Tensor",
       "aten::float_power.Scalar",
       "aten::xlogy.Scalar_Self",
       "aten::xlogy.Scalar_Other",
       "aten::special_xlog1py",
       "aten::special_xlog1py.self_scalar",
       "aten::special_xlog1py.other_scalar",
       "aten::special_erfcx",
       "aten::special_entr",
       "aten::special_ndtri",
       "aten::special_log_ndtr",
       "aten::special_i0e",
       "aten::special_i1",
       "aten::special_i1e",
       "aten::special_zeta",
       "aten::special_airy_ai",
       "aten::special_bessel_j0",
       "aten::special_bessel_j1",
       "aten::special_bessel_y0",
       "aten::special_bessel_y1",
       "aten::special_spherical_bessel_j0",
       "aten::special_modified_bessel_i0",
       "aten::special_modified_bessel_i1",
       "aten::special_modified_bessel_k0",
       "aten::special_modified_bessel_k1",
       "aten::special_scaled_modified_bessel_k0",
       "aten::special_scaled_modified_bessel_k1",
       "aten::hardshrink",
       "aten::hardshrink_backward",
       "aten::softshrink",
       "aten::softshrink_backward",
       "aten::conj_physical",
       "aten::gcd",
       "aten::lcm",
       "aten::bitwise_left_shift.Tensor",
       "aten::bitwise_right_shift.Tensor"},
      L::None);
  reg({"aten::add.Scalar", "aten::sub.Scalar"}, L::Shift);
  reg({"aten::add_.Scalar", "aten::sub_.Scalar"}, L::Shift, Write::InPlace);
  reg({"aten::div_.Tensor",
       "aten::div_.Tensor_mode",
       "aten::pow_.Scalar",
       "aten::pow_.Tensor",
       "aten::abs_",
       "aten::exp_",
       "aten::log_",
       "aten::sqrt_",
       "aten::rsqrt_",
       "aten::sigmoid_",
       "aten::tanh_",
       "aten::relu_",
       "aten::silu_",
       "aten::gelu_",
       "aten::clamp_",
       "aten::clamp_min_",
       "aten::clamp_max_",
       "aten::clamp_.Tensor",
       "aten::addcmul_",
       "aten::addcdiv_",
       "aten::lerp_.Scalar",
       "aten::lerp_.Tensor",
       "aten::masked_fill_.Scalar",
       "aten::masked_fill_.Tensor",
       "aten::reciprocal_",
       "aten::sign_",
       "aten::floor_",
       "aten::ceil_",
       "aten::round_",
       "aten::hardtanh_",
       "aten::leaky_relu_",
       "aten::threshold_",
       "aten::nan_to_num_",
       "aten::square_",
       "aten::erf_",
       "aten::logical_not_",
       "aten::logical_and_",
       "aten::logical_or_",
       "aten::logical_xor_",
       "aten::bitwise_and_.Tensor",
       "aten::bitwise_or_.Tensor",
       "aten::deg2rad_",
       "aten::rad2deg_",
       "aten::erfc_",
       "aten::i0_",
       "aten::igamma_",
       "aten::igammac_",
       "aten::round_.decimals",
       "aten::asinh_",
       "aten::atan_",
       "aten::exp2_",
       "aten::expm1_",
       "aten::sgn_",
       "aten::sinh_",
       "aten::trunc_",
       "aten::polygamma_",
       "aten::mvlgamma_",
       "aten::digamma_",
       "aten::nextafter_",
       "aten::copysign_.Tensor",
       "aten::copysign_.Scalar",
       "aten::ldexp_",
       "aten::xlogy_.Tensor"},
      L::None, Write::InPlace);
  // out= variants libtorch's optimizers call (AdamW/Adam with amsgrad: max_out).
  reg({"aten::maximum.out", "aten::minimum.out"}, L::None, Write::Out);
}

}  // namespace dtensor::ops
