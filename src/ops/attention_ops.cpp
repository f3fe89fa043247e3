// Fused scaled-dot-product attention kernels. Attention is independent per batch element and per
// head, so on each mesh dim q, k, v and the [B, H, ...] results are either all replicated, all
// split along heads (dim 1) or all split along batch (dim 0); RNG state stays replicated. None of
// these kernels has a C++ meta function, so every rule also gives the global metadata of the
// results.
#include <ATen/OpMathType.h>
#include <ATen/ops/empty_strided.h>

#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

enum class Role : uint8_t {
  Follow,     // a [B, H, ...] tensor: laid out as the option says
  Mask,       // laid out like the attention mask / bias (broadcast against [B, H, L, S])
  Replicate,  // always replicated
  None,       // no placement: an undefined tensor or a non-tensor
};

// How one attention op's tensors follow an option, and its results' global metadata.
struct Layout {
  int query = 0, key = 1;        // argument indices of q and k
  std::vector<int> follow_args;  // [B, H, ...] inputs
  int mask_arg = -1;             // argument index of the mask / bias, -1 if none
  std::vector<Role> returns;     // one per return
  std::vector<std::optional<TensorMeta>> meta;
  bool guard_empty = false;  // the kernel cannot take an empty shard (all returns tensors)
};

const DTensorSpec* spec_of_arg(const OpCall& call, int arg) {
  for (const auto& in : call.inputs()) {
    if (in.arg == arg && in.list_index < 0 && in.spec) return in.spec.get();
  }
  return nullptr;
}

const DTensorSpec& required_arg(const OpCall& call, int arg) {
  const DTensorSpec* s = spec_of_arg(call, arg);
  TORCH_CHECK(s, call.name(), ": tensor argument ", arg, " is undefined");
  return *s;
}

// Strides of a dense tensor of `shape` whose dims are laid out in memory in `order`
// (outermost first), as torch.empty_permuted makes them.
std::vector<int64_t> permuted_strides(c10::IntArrayRef shape,
                                      std::initializer_list<int64_t> order) {
  std::vector<int64_t> s(shape.size(), 1);
  int64_t acc = 1;
  for (auto it = std::rbegin(order); it != std::rend(order); ++it) {
    s[*it] = acc;
    acc *= std::max<int64_t>(shape[*it], 1);
  }
  return s;
}

TensorMeta meta_like(const DTensorSpec& like, std::vector<int64_t> shape,
                     std::optional<at::ScalarType> dtype = std::nullopt) {
  auto stride = strides_like(shape, like.stride());
  return TensorMeta{std::move(shape), std::move(stride), dtype.value_or(like.dtype())};
}

// Gradients of q, k, v laid out as (B, L, H, D) in memory, as the CPU and memory-efficient
// backward kernels return them.
TensorMeta grad_bshd(const DTensorSpec& like) {
  return TensorMeta{like.shape(), permuted_strides(like.shape(), {0, 2, 1, 3}), like.dtype()};
}

// Placement of the mask for an option that splits output dim `dim` of [B, H, L, S]: the
// matching mask dim, or Replicate where the mask broadcasts along it.
Placement mask_placement(const DTensorSpec& mask, const Placement& follow) {
  if (!follow.is_shard()) return follow;
  const int64_t d = follow.dim() - (4 - mask.ndim());
  if (d < 0 || mask.shape()[d] == 1) return Replicate();
  return Shard(d);
}

// The CPU kernels divide work by the sizes they get and fail on an empty shard (uneven heads
// or batch leave the last ranks without any): such a rank returns empty results instead.
void skip_empty_shards(const c10::OperatorHandle& op, torch::jit::Stack& stack,
                       const dispatch::LocalContext& ctx) {
  const size_t nargs = op.schema().arguments().size();
  std::optional<at::TensorOptions> opts;
  bool empty = false;
  for (size_t i = stack.size() - nargs; i < stack.size(); ++i) {
    if (!stack[i].isTensor() || !stack[i].toTensor().defined()) continue;
    const at::Tensor& t = stack[i].toTensor();
    if (!opts) opts = t.options();
    empty = empty || t.numel() == 0;
  }
  if (!empty) {
    op.callBoxed(stack);
    return;
  }
  torch::jit::drop(stack, nargs);
  for (const SpecPtr& s : ctx.outputs) {
    const auto local = s->local_shape();
    stack.emplace_back(
        at::empty_strided(local, strides_like(local, s->stride()), opts->dtype(s->dtype())));
  }
}

Decision attention(const OpCall& call, const Layout& L) {
  const DeviceMesh& mesh = call.mesh();
  const DTensorSpec& q = required_arg(call, L.query);
  const DTensorSpec& k = required_arg(call, L.key);
  const DTensorSpec* mask = L.mask_arg >= 0 ? spec_of_arg(call, L.mask_arg) : nullptr;
  // Per mesh dim: all replicated, heads split, batch split (PyTorch's order).
  const std::vector<Placement> options =
      q.ndim() == 4 ? std::vector<Placement>{Replicate(), Shard(1), Shard(0)}
                    : std::vector<Placement>{Replicate()};
  // One DimStrategy per option: the tensor returns, then every input, by role.
  std::vector<DimStrategy> choices;
  for (const Placement& follow : options) {
    const Placement mask_p = mask ? mask_placement(*mask, follow) : Placement(Replicate());
    DimStrategy c;
    for (size_t r = 0; r < L.returns.size(); ++r) {
      if (call.schema().returns()[r].type()->kind() != c10::TypeKind::TensorType) continue;
      // Replicate is also the placeholder for None, replaced after the choice.
      c.push_back(L.returns[r] == Role::Follow ? follow
                  : L.returns[r] == Role::Mask ? mask_p
                                               : Placement(Replicate()));
    }
    for (const auto& in : call.inputs()) {
      const bool f =
          std::find(L.follow_args.begin(), L.follow_args.end(), in.arg) != L.follow_args.end();
      const bool is_mask = mask && in.arg == L.mask_arg;
      c.push_back(f ? follow : is_mask ? mask_p : Placement(Replicate()));
    }
    choices.push_back(std::move(c));
  }
  size_t num_outputs = 0;
  for (size_t r = 0; r < L.returns.size(); ++r) {
    num_outputs += call.schema().returns()[r].type()->kind() == c10::TypeKind::TensorType;
  }
  // Grouped-query attention maps q head i to k head i / (Hq / Hk): a heads split keeps that
  // mapping inside each shard only when it cuts the k heads evenly.
  const int query_input = input_of(call, L.query);
  auto keeps_kv_groups = [&](const Strategy& s) {
    if (q.ndim() != 4 || k.ndim() != 4 || q.shape()[1] == k.shape()[1]) return true;
    return k.shape()[1] % shards_of_dim(mesh, s.inputs[query_input], 1) == 0;
  };
  const std::vector<Strategy> candidates =
      expand_to_mesh(call, choices, num_outputs, keeps_kv_groups);
  Decision d = dispatch::choose(call, candidates);
  for (size_t r = 0; r < L.returns.size(); ++r) {
    if (L.returns[r] == Role::None) d.outputs[r] = std::nullopt;
  }
  d.output_meta = L.meta;
  if (L.guard_empty) d.local_kernel = skip_empty_shards;
  return d;
}

// _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
// scale) -> (output, logsumexp)
Layout flash_cpu(const OpCall& call) {
  Layout L;
  L.follow_args = {0, 1, 2};
  L.mask_arg = 5;
  L.returns = {Role::Follow, Role::Follow};
  L.guard_empty = true;
  const auto& q = required_arg(call, 0);
  const auto& v = required_arg(call, 2);
  const auto& s = q.shape();
  TORCH_CHECK(q.ndim() == 4, call.name(), ": expected 4-D query [B, H, L, E], got ", q.ndim(),
              " dims");
  // lse is (B, H, L) laid out as (B, L, H), in the kernel's accumulation type.
  L.meta.push_back(meta_like(q, {s[0], s[1], s[2], v.shape()[3]}));
  L.meta.push_back(
      TensorMeta{{s[0], s[1], s[2]}, {s[1] * s[2], 1, s[1]}, at::toOpMathType(q.dtype())});
  return L;
}

// _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, logsumexp,
// dropout_p, is_causal, *, attn_mask, scale) -> (grad_q, grad_k, grad_v)
Layout flash_cpu_backward(const OpCall& call) {
  Layout L;
  L.query = 1;
  L.key = 2;
  L.follow_args = {0, 1, 2, 3, 4, 5};
  L.mask_arg = 8;
  L.returns = {Role::Follow, Role::Follow, Role::Follow};
  L.guard_empty = true;
  for (int a : {1, 2, 3}) L.meta.push_back(grad_bshd(required_arg(call, a)));
  return L;
}

// _scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, return_debug_mask, *,
// scale) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused,
// debug_attn_mask)
Layout flash_cuda(const OpCall& call) {
  Layout L;
  L.follow_args = {0, 1, 2};
  const bool debug = call.bool_arg(5);
  L.returns = {Role::Follow,    Role::Follow, Role::None,
               Role::None,      Role::None,   Role::None,
               Role::Replicate, Role::None,   debug ? Role::Follow : Role::Replicate};
  const auto& q = required_arg(call, 0);
  const auto& s = q.shape();
  L.meta.resize(9);
  L.meta[0] = meta_like(q, s);
  L.meta[1] = contiguous_meta({s[0], s[1], s[2]}, at::kFloat);
  L.meta[6] = contiguous_meta({2}, at::kUInt64);
  if (debug) {
    // The kernel sizes the debug mask's last dim by its block size (as PyTorch's meta does).
    const int64_t sk = required_arg(call, 1).shape()[2];
    const int64_t block = s[3] > 64 ? 128 : 256;
    const int64_t cols = sk <= 128 ? 128 : sk <= 256 ? 256 : (s[2] + block - 1) / block;
    L.meta[8] = contiguous_meta({s[0], s[1], s[2], cols}, q.dtype());
  } else {
    L.meta[8] = contiguous_meta({0}, q.dtype());
  }
  return L;
}

// _scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, logsumexp, cum_seq_q,
// cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale)
Layout flash_cuda_backward(const OpCall& call) {
  Layout L;
  L.query = 1;
  L.key = 2;
  L.follow_args = {0, 1, 2, 3, 4, 5};
  L.returns = {Role::Follow, Role::Follow, Role::Follow};
  for (int a : {1, 2, 3}) {
    const auto& t = required_arg(call, a);
    L.meta.push_back(meta_like(t, t.shape()));
  }
  return L;
}

// _scaled_dot_product_efficient_attention(q, k, v, attn_bias, compute_log_sumexp,
// dropout_p, is_causal, *, scale) -> (output, log_sumexp, philox_seed, philox_offset)
Layout efficient_cuda(const OpCall& call) {
  Layout L;
  L.follow_args = {0, 1, 2};
  L.mask_arg = 3;
  const bool lse = call.bool_arg(4);
  L.returns = {Role::Follow, lse ? Role::Follow : Role::Replicate, Role::None, Role::None};
  const auto& q = required_arg(call, 0);
  const auto& s = q.shape();
  std::vector<int64_t> out_shape{s[0], s[1], s[2], required_arg(call, 2).shape()[3]};
  L.meta.resize(4);
  L.meta[0] = TensorMeta{out_shape, permuted_strides(out_shape, {0, 2, 1, 3}), q.dtype()};
  // The kernel rounds the logsumexp length up to a multiple of 32.
  L.meta[1] = contiguous_meta({s[0], s[1], lse ? (s[2] + 31) / 32 * 32 : 0}, at::kFloat);
  return L;
}

// _scaled_dot_product_efficient_attention_backward(grad_out_, q, k, v, attn_bias, out,
// logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal, *, scale)
// -> (grad_q, grad_k, grad_v, grad_bias)
Layout efficient_cuda_backward(const OpCall& call) {
  Layout L;
  L.query = 1;
  L.key = 2;
  L.follow_args = {0, 1, 2, 3, 5, 6};
  L.mask_arg = 4;
  const DTensorSpec* bias = spec_of_arg(call, 4);
  const auto mask = call.arg(10).toBoolList();
  const bool grad_bias = bias && mask.size() > 3 && mask.get(3);
  L.returns = {Role::Follow, Role::Follow, Role::Follow, grad_bias ? Role::Mask : Role::None};
  for (int a : {1, 2, 3}) L.meta.push_back(grad_bshd(required_arg(call, a)));
  L.meta.emplace_back();
  if (grad_bias) {
    // Allocated with the last dim padded to a multiple of 16, then narrowed.
    std::vector<int64_t> padded = bias->shape();
    padded.back() = (padded.back() + 15) / 16 * 16;
    L.meta[3] = TensorMeta{bias->shape(), default_strides(padded), bias->dtype()};
  }
  return L;
}

// _scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p,
// is_causal, return_debug_mask, *, scale) -> (output, logsumexp, cum_seq_q, cum_seq_k,
// max_q, max_k, philox_seed, philox_offset, debug_attn_mask)
Layout cudnn_cuda(const OpCall& call) {
  Layout L;
  L.follow_args = {0, 1, 2};
  L.mask_arg = 3;
  const bool lse = call.bool_arg(4);
  // The debug mask is never materialised by this kernel.
  L.returns = {Role::Follow, lse ? Role::Follow : Role::Replicate,
               Role::None,   Role::None,
               Role::None,   Role::None,
               Role::None,   Role::None,
               Role::None};
  const auto& q = required_arg(call, 0);
  const auto& s = q.shape();
  L.meta.resize(9);
  L.meta[0] = meta_like(q, {s[0], s[1], s[2], required_arg(call, 2).shape()[3]});
  L.meta[1] = contiguous_meta({s[0], s[1], s[2], 1}, at::kFloat);
  return L;
}

// _scaled_dot_product_cudnn_attention_backward(grad_out, q, k, v, out, logsumexp,
// philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
// is_causal, *, scale) -> (grad_q, grad_k, grad_v): flash's layout plus the attn_bias.
Layout cudnn_cuda_backward(const OpCall& call) {
  Layout L = flash_cuda_backward(call);
  L.mask_arg = 8;
  return L;
}

dispatch::Rule rule(Layout (*layout)(const OpCall&)) {
  return [layout](const OpCall& call) { return attention(call, layout(call)); };
}

}  // namespace

DTENSOR_RULES(attention_ops) {
  using dispatch::register_rule;
  register_rule("aten::_scaled_dot_product_flash_attention_for_cpu", rule(flash_cpu));
  register_rule("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                rule(flash_cpu_backward));
  register_rule("aten::_scaled_dot_product_flash_attention", rule(flash_cuda));
  register_rule("aten::_scaled_dot_product_flash_attention_backward", rule(flash_cuda_backward));
  register_rule("aten::_scaled_dot_product_efficient_attention", rule(efficient_cuda));
  register_rule("aten::_scaled_dot_product_efficient_attention_backward",
                rule(efficient_cuda_backward));
  register_rule("aten::_scaled_dot_product_cudnn_attention", rule(cudnn_cuda));
  register_rule("aten::_scaled_dot_product_cudnn_attention_backward", rule(cudnn_cuda_backward));
}

}  // namespace dtensor::ops
