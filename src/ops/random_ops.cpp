// Random ops drawing from DTensor's counter-based stream (core/random.h) instead of the local
// generator: every rank reserves the counters of the whole global tensor, in the same order, and
// computes the values of its own block. Replicas therefore draw equal numbers, shards disjoint
// ones, and the full tensor equals the single-device draw for the same seed, whatever the mesh or
// placements (uneven shards included). An explicit Generator argument is ignored: the stream is
// seeded with dtensor::manual_seed.
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/ones_like.h>

#include "dtensor/core/random.h"
#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

using dispatch::LocalContext;

int64_t numel_of(c10::IntArrayRef shape) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

// This rank's block (in double, on the CPU) of a fresh draw over the tensor `spec` describes.
at::Tensor draw(const DTensorSpec& spec, bool normal) {
  const random::Draw d = random::reserve(numel_of(spec.shape()));
  const LocalShard block = spec.local_shard();
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  return normal ? random::normal_block(d, spec.shape(), block.shape, block.offset, opts)
                : random::uniform_block(d, spec.shape(), block.shape, block.offset, opts);
}

// A new local tensor for output spec `out` holding `values`, laid out like the global tensor.
at::Tensor new_local(const DTensorSpec& out, const at::Tensor& values, at::TensorOptions opts) {
  const LocalShard block = out.local_shard();
  return at::empty_strided(block.shape, strides_like(block.shape, out.stride()), opts)
      .copy_(values);
}

// Output metadata: random kernels have no C++ meta implementation to ask.
TensorMeta meta_like(const DTensorSpec& in, at::ScalarType dtype) {
  return TensorMeta{in.shape(), default_strides(in.shape()), dtype};
}

size_t args_base(const c10::OperatorHandle& op, const torch::jit::Stack& st) {
  return st.size() - op.schema().arguments().size();
}

void check_not_partial(const OpCall& call) {
  const auto& self = call.input(0);
  TORCH_CHECK(!self.has_partial(), call.name(), ": cannot fill a DTensor with placements ",
              to_string(self.placements()), " with random values in place (a Partial tensor's ",
              "value is the reduction over ranks); redistribute it to Replicate or Shard first");
}

// ---------------------------------------------------------------------------------------------
// in-place fills: the written tensor keeps its layout

// How the uniform/normal block becomes the values of op(self, a, b).
enum class Fill { Bernoulli, Uniform, Normal };

Decision fill_inplace(const OpCall& call, Fill kind) {
  check_not_partial(call);
  Decision d = all_outputs(call, {call.input(0).placements()}, call.input(0).placements());
  d.output_meta = {call.input(0).meta()};
  d.local_kernel = [kind](const c10::OperatorHandle& op, torch::jit::Stack& st,
                          const LocalContext& ctx) {
    const size_t base = args_base(op, st);
    at::Tensor self = st[base].toTensor();
    const double a = st[base + 1].toDouble();
    const double b = kind == Fill::Bernoulli ? 0.0 : st[base + 2].toDouble();
    const at::Tensor v = draw(*ctx.outputs[0], kind == Fill::Normal);
    switch (kind) {
      case Fill::Bernoulli:
        self.copy_(v.lt(a));
        break;  // bernoulli_(p)
      case Fill::Uniform:
        self.copy_(v.mul(b - a).add_(a));
        break;  // uniform_(from, to)
      case Fill::Normal:
        self.copy_(v.mul(b).add_(a));
        break;  // normal_(mean, std)
    }
    torch::jit::drop(st, op.schema().arguments().size());
    st.emplace_back(self);
  };
  return d;
}

// bernoulli_.Tensor(self, p): p follows self's layout through broadcasting.
Decision bernoulli_tensor_inplace(const OpCall& call) {
  check_not_partial(call);
  const auto& self = call.input(0);
  const auto& p = call.input(1);
  const int64_t off = self.ndim() - p.ndim();
  Placements pt = remap_shards(self.placements(), [&](int64_t d) -> std::optional<int64_t> {
    const int64_t pd = d - off;
    if (pd < 0 || (p.shape()[pd] == 1 && self.shape()[d] != 1)) return std::nullopt;
    return pd;
  });
  Decision d = all_outputs(call, {self.placements(), pt}, self.placements());
  d.output_meta = {self.meta()};
  d.local_kernel = [](const c10::OperatorHandle& op, torch::jit::Stack& st,
                      const LocalContext& ctx) {
    const size_t base = args_base(op, st);
    at::Tensor self = st[base].toTensor();
    const at::Tensor prob = st[base + 1].toTensor().to(at::kCPU, at::kDouble);
    self.copy_(draw(*ctx.outputs[0], false).lt(prob));
    torch::jit::drop(st, op.schema().arguments().size());
    st.emplace_back(self);
  };
  return d;
}

// ---------------------------------------------------------------------------------------------
// out-of-place draws

// bernoulli.p(self, p): only self's shape and dtype matter, so a Partial self stays as it is.
Decision bernoulli_p(const OpCall& call) {
  Decision d = all_outputs(call, {{}}, clear_partial(call.input(0).placements()));
  d.output_meta = {meta_like(call.input(0), call.input(0).dtype())};
  d.local_kernel = [](const c10::OperatorHandle& op, torch::jit::Stack& st,
                      const LocalContext& ctx) {
    const size_t base = args_base(op, st);
    const at::Tensor self = st[base].toTensor();
    const double p = st[base + 1].toDouble();
    const DTensorSpec& out = *ctx.outputs[0];
    at::Tensor r = new_local(out, draw(out, false).lt(p), self.options());
    torch::jit::drop(st, op.schema().arguments().size());
    st.emplace_back(std::move(r));
  };
  return d;
}

// bernoulli(self): self holds the probabilities, so it must be a value (not Partial).
Decision bernoulli(const OpCall& call) {
  const Placements p = clear_partial(call.input(0).placements());
  Decision d = all_outputs(call, {p}, p);
  d.output_meta = {meta_like(call.input(0), call.input(0).dtype())};
  d.local_kernel = [](const c10::OperatorHandle& op, torch::jit::Stack& st,
                      const LocalContext& ctx) {
    const size_t base = args_base(op, st);
    const at::Tensor self = st[base].toTensor();
    const DTensorSpec& out = *ctx.outputs[0];
    at::Tensor r =
        new_local(out, draw(out, false).lt(self.to(at::kCPU, at::kDouble)), self.options());
    torch::jit::drop(st, op.schema().arguments().size());
    st.emplace_back(std::move(r));
  };
  return d;
}

// native_dropout(input, p, train) -> (input * keep / (1 - p), keep), keep = uniform < 1 - p.
// For a given p the output is the input times a non-negative factor that depends only on the
// element's global index. Ranks that hold parts of a Partial value (they differ only in a
// Partial mesh dim) draw the same mask, so reducing the outputs equals dropping out the reduced
// input: sum/avg/max/min and norm Partials are kept (no all-reduce); a product is reduced first.
// The mask is Replicate on those mesh dims.
Decision native_dropout(const OpCall& call) {
  Placements keep;
  for (const auto& x : call.input(0).placements()) {
    keep.push_back(x.is_partial() && x.reduce_op() == ReduceOp::Product ? Replicate() : x);
  }
  Decision d;
  d.inputs = {keep};
  d.outputs = {keep, clear_partial(keep)};
  d.output_meta = {meta_like(call.input(0), call.input(0).dtype()),
                   meta_like(call.input(0), at::kBool)};
  d.local_kernel = [](const c10::OperatorHandle& op, torch::jit::Stack& st,
                      const LocalContext& ctx) {
    const size_t base = args_base(op, st);
    const at::Tensor x = st[base].toTensor();
    const double p = st[base + 1].toDouble();
    const bool train = st[base + 2].isNone() || st[base + 2].toBool();
    torch::jit::drop(st, 3);
    if (!train) {  // no draw at all, as on one device
      st.emplace_back(x.clone());
      st.emplace_back(at::ones_like(x, x.options().dtype(at::kBool)));
      return;
    }
    const at::Tensor mask = draw(*ctx.outputs[0], false).lt(1.0 - p).to(x.device());
    const double scale = p >= 1.0 ? 0.0 : 1.0 / (1.0 - p);
    st.emplace_back(x.mul(mask).mul_(scale));
    st.emplace_back(mask);
  };
  return d;
}

// *_like factories: follow the input's layout (Partial cleared, values are not partial sums).
// Arguments after self: [low, high,] dtype, layout, device, pin_memory, memory_format.
enum class Like { Uniform, Normal, Int, IntLow };

Decision random_like(const OpCall& call, Like kind) {
  Decision d = all_outputs(call, {{}}, clear_partial(call.input(0).placements()));
  const size_t dtype_arg = kind == Like::Int ? 2 : kind == Like::IntLow ? 3 : 1;
  const auto& dt = call.arg(dtype_arg);
  d.output_meta = {
      meta_like(call.input(0), dt.isNone() ? call.input(0).dtype() : dt.toScalarType())};
  d.local_kernel = [kind](const c10::OperatorHandle& op, torch::jit::Stack& st,
                          const LocalContext& ctx) {
    const size_t base = args_base(op, st);
    const at::Tensor self = st[base].toTensor();
    const size_t first = kind == Like::Int ? 2 : kind == Like::IntLow ? 3 : 1;  // dtype
    at::TensorOptions opts = self.options();
    if (!st[base + first].isNone()) opts = opts.dtype(st[base + first].toScalarType());
    if (!st[base + first + 2].isNone()) opts = opts.device(st[base + first + 2].toDevice());
    const DTensorSpec& out = *ctx.outputs[0];
    at::Tensor v = draw(out, kind == Like::Normal);
    if (kind == Like::Int || kind == Like::IntLow) {
      const int64_t low = kind == Like::IntLow ? st[base + 1].toInt() : 0;
      const int64_t high = st[base + first - 1].toInt();
      v = v.mul_(static_cast<double>(high - low)).floor_().add_(static_cast<double>(low));
    }
    at::Tensor r = new_local(out, v, opts);
    torch::jit::drop(st, op.schema().arguments().size());
    st.emplace_back(std::move(r));
  };
  return d;
}

}  // namespace

DTENSOR_RULES(random_ops) {
  using dispatch::register_rule;
  register_rule("aten::native_dropout", native_dropout);
  register_rule("aten::bernoulli_.float",
                [](const OpCall& c) { return fill_inplace(c, Fill::Bernoulli); });
  register_rule("aten::bernoulli_.Tensor", bernoulli_tensor_inplace);
  register_rule("aten::uniform_", [](const OpCall& c) { return fill_inplace(c, Fill::Uniform); });
  register_rule("aten::normal_", [](const OpCall& c) { return fill_inplace(c, Fill::Normal); });
  register_rule("aten::bernoulli.p", bernoulli_p);
  register_rule("aten::bernoulli", bernoulli);
  // Replace the placement-only rules of tensor_ops.cpp, which draw from the local generator.
  register_rule("aten::rand_like", [](const OpCall& c) { return random_like(c, Like::Uniform); });
  register_rule("aten::randn_like", [](const OpCall& c) { return random_like(c, Like::Normal); });
  register_rule("aten::randint_like", [](const OpCall& c) { return random_like(c, Like::Int); });
  register_rule("aten::randint_like.low_dtype",
                [](const OpCall& c) { return random_like(c, Like::IntLow); });
}

}  // namespace dtensor::ops
