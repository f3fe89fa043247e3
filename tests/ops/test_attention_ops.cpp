// Scaled-dot-product attention on DTensors (the CPU flash kernel and its backward) against one
// device: heads- and batch-split q/k/v, masks, causal, grouped-query attention. The CUDA
// kernels' rules are checked through CPU stand-ins registered for those ops in this binary.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/library.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

struct Sdpa {
  bool causal = false;
  bool gqa = false;
  bool with_mask = false;  // inputs[3] is a float mask
};

OpFn sdpa(Sdpa o) {
  return [o](const std::vector<at::Tensor>& x) {
    std::optional<at::Tensor> mask;
    if (o.with_mask) mask = x[3];
    return std::vector<at::Tensor>{at::scaled_dot_product_attention(x[0], x[1], x[2], mask, 0.0,
                                                                    o.causal, std::nullopt, o.gqa)};
  };
}

std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

// Same placement for q, k and v, plus mixed ones; a mask is replicated or follows the split.
std::vector<std::vector<Placements>> qkv_placements() {
  const Placements R{Replicate()}, S0{Shard(0)}, S1{Shard(1)}, S2{Shard(2)}, P{Partial()};
  return {{R, R, R},   {S1, S1, S1}, {S0, S0, S0}, {S2, S2, S2}, {P, P, P},
          {S1, R, S1}, {R, S1, S0},  {S0, S1, R},  {S1, S2, P}};
}

// 3 shapes x (2 causal x 9 layouts + 3 masks x the 8 layouts without Partial) = 126 cases.
constexpr int64_t kSdpaCases = 3 * (2 * 9 + 3 * 8);

SweepCounter sweep(const DeviceMesh& mesh, at::ScalarType dtype, double tol) {
  SweepCounter n;
  const OpCheckOptions opts{.rtol = tol, .atol = tol};
  auto rnd = [dtype](c10::IntArrayRef s) { return at::randn(s, at::TensorOptions().dtype(dtype)); };
  // (B, H, L, E) for q and (B, H, S, E) for k, v: even, uneven heads/batch, L != S.
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> shapes = {
      {{2, 4, 5, 8}, {2, 4, 5, 8}}, {{3, 3, 4, 6}, {3, 3, 7, 6}}, {{1, 2, 6, 4}, {1, 2, 6, 4}}};
  for (const auto& [qs, ks] : shapes) {
    const auto q = rnd(qs), k = rnd(ks), v = rnd(ks);
    for (bool causal : {false, true}) {
      for (const auto& pl : qkv_placements()) {
        const std::string label = std::string("sdpa") + (causal ? " causal " : " ") + shape_str(q) +
                                  shape_str(k) + " " + to_string(pl[0]) + to_string(pl[1]) +
                                  to_string(pl[2]);
        n.add(check_op(mesh, label, sdpa({.causal = causal}), {q, k, v}, pl, opts));
      }
    }
    // Masks: (L, S) broadcast, (B, 1, L, S) broadcast over heads, (B, H, L, S) full.
    const int64_t B = qs[0], H = qs[1], L = qs[2], S = ks[2];
    for (auto ms : std::vector<std::vector<int64_t>>{{L, S}, {B, 1, L, S}, {B, H, L, S}}) {
      const auto mask = rnd(ms);
      for (const auto& pl : qkv_placements()) {
        if (pl[0][0].is_partial()) continue;
        auto with_mask = pl;
        // The mask is split like q where it has the dim, else replicated.
        const Placement& qp = pl[0][0];
        const bool has_dim =
            qp.is_shard() && static_cast<int64_t>(ms.size()) == 4 && ms[qp.dim()] != 1;
        with_mask.push_back(has_dim ? Placements{qp} : Placements{Replicate()});
        const std::string label = "sdpa mask " + c10::str(c10::IntArrayRef(ms)) + " " +
                                  to_string(pl[0]) + to_string(pl[1]) + to_string(pl[2]) +
                                  to_string(with_mask[3]);
        OpCheckOptions mo = opts;
        mo.requires_grad = {true, true, true, false};
        n.add(check_op(mesh, label, sdpa({.with_mask = true}), {q, k, v, mask}, with_mask, mo));
      }
    }
  }
  return n;
}

}  // namespace

TEST(AttentionSweep, Float64MatchesOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      at::manual_seed(11);
      auto mesh = init_device_mesh("cpu", {world});
      sweep(mesh, at::kDouble, 1e-10)
          .expect_cases(kSdpaCases, rank, c10::str("sdpa float64, world ", world));
    });
  }
}

TEST(AttentionSweep, Float32MatchesOneDevice) {
  for (int world : {2, 4}) {
    run_ranks(world, [world](int rank) {
      at::manual_seed(12);
      auto mesh = init_device_mesh("cpu", {world});
      sweep(mesh, at::kFloat, 1e-5)
          .expect_cases(kSdpaCases, rank, c10::str("sdpa float32, world ", world));
    });
  }
}

// Heads split on q, k, v: the attention kernels run on local heads, forward and backward,
// without any communication, and everything stays split on heads.
TEST(Attention, HeadsSplitNeedsNoCommunication) {
  for (int world : {2, 4}) {
    run_ranks(world, [world](int) {
      auto mesh = init_device_mesh("cpu", {world});
      at::manual_seed(13);
      auto q0 = at::randn({2, 4, 5, 8}, at::kDouble), k0 = at::randn({2, 4, 5, 8}, at::kDouble),
           v0 = at::randn({2, 4, 5, 8}, at::kDouble), g0 = at::randn({2, 4, 5, 8}, at::kDouble);
      auto q = distribute_tensor(q0, mesh, {Shard(1)}).requires_grad_(true);
      auto k = distribute_tensor(k0, mesh, {Shard(1)}).requires_grad_(true);
      auto v = distribute_tensor(v0, mesh, {Shard(1)}).requires_grad_(true);
      auto g = distribute_tensor(g0, mesh, {Shard(1)});
      CommDebugMode comm;
      auto out = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true);
      EXPECT_EQ(placements(out)[0], Shard(1));
      (out * g).sum().backward();
      EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
      for (const auto& t : {q, k, v}) EXPECT_EQ(placements(t.grad())[0], Shard(1));
      comm.exit();
      auto qr = q0.clone().requires_grad_(true), kr = k0.clone().requires_grad_(true),
           vr = v0.clone().requires_grad_(true);
      auto ref = at::scaled_dot_product_attention(qr, kr, vr, std::nullopt, 0.0, true);
      (ref * g0).sum().backward();
      EXPECT_TENSOR_CLOSE(full_tensor(out), ref, 1e-10, 1e-10);
      EXPECT_TENSOR_CLOSE(full_tensor(q.grad()), qr.grad(), 1e-10, 1e-10);
      EXPECT_TENSOR_CLOSE(full_tensor(k.grad()), kr.grad(), 1e-10, 1e-10);
      EXPECT_TENSOR_CLOSE(full_tensor(v.grad()), vr.grad(), 1e-10, 1e-10);
    });
  }
}

// Batch split: same, along dim 0.
TEST(Attention, BatchSplitNeedsNoCommunication) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::manual_seed(14);
    auto q0 = at::randn({4, 2, 3, 4}, at::kDouble);
    auto q = distribute_tensor(q0, mesh, {Shard(0)}).requires_grad_(true);
    auto g = distribute_tensor(at::randn_like(q0), mesh, {Shard(0)});
    CommDebugMode comm;
    auto out = at::scaled_dot_product_attention(q, q, q);
    EXPECT_EQ(placements(out)[0], Shard(0));
    (out * g).sum().backward();
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    EXPECT_EQ(placements(q.grad())[0], Shard(0));
  });
}

// Grouped-query attention: 4 query heads share 2 key/value heads. With enable_gqa the kernel
// maps heads itself; a heads split is kept only where it cuts the key/value heads evenly
// (2 ranks), otherwise (3, 4 ranks) the inputs are laid out another way.
TEST(Attention, GroupedQueryAttentionMatchesOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      at::manual_seed(15);
      const auto q = at::randn({2, 4, 5, 6}, at::kDouble), k = at::randn({2, 2, 5, 6}, at::kDouble),
                 v = at::randn({2, 2, 5, 6}, at::kDouble);
      SweepCounter n;
      const Placements R{Replicate()}, S0{Shard(0)}, S1{Shard(1)};
      for (const auto& pl : std::vector<std::vector<Placements>>{
               {S1, S1, S1}, {S0, S0, S0}, {S1, R, R}, {R, S1, S1}}) {
        const std::string suffix = to_string(pl[0]) + to_string(pl[1]) + to_string(pl[2]);
        for (bool causal : {false, true}) {
          n.add(check_op(mesh, "gqa " + suffix, sdpa({.causal = causal, .gqa = true}), {q, k, v},
                         pl));
        }
      }
      if (world == 2) {
        // 2 key/value heads on 2 ranks: the heads split is kept, no communication.
        auto qd = distribute_tensor(q, mesh, {Shard(1)}),
             kd = distribute_tensor(k, mesh, {Shard(1)}),
             vd = distribute_tensor(v, mesh, {Shard(1)});
        CommDebugMode comm;
        auto out = at::scaled_dot_product_attention(qd, kd, vd, std::nullopt, 0.0, false,
                                                    std::nullopt, true);
        EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
        EXPECT_EQ(placements(out)[0], Shard(1));
      }
      n.expect_cases(4 * 2, rank, c10::str("grouped-query sdpa, world ", world));
    });
  }
}

// Grouped-query attention written out: key/value heads repeated before a plain call, with
// repeat_interleave or expand + reshape (as Llama's repeat_kv). The backward reshapes the
// attention gradients, which the kernel lays out as (B, L, H, D).
TEST(Attention, RepeatedKeyValueHeadsMatchOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      at::manual_seed(16);
      SweepCounter n;
      const auto q = at::randn({2, 4, 5, 6}, at::kDouble), k = at::randn({2, 2, 5, 6}, at::kDouble),
                 v = at::randn({2, 2, 5, 6}, at::kDouble);
      const Placements R{Replicate()}, S0{Shard(0)}, S1{Shard(1)};
      for (const auto& pl :
           std::vector<std::vector<Placements>>{{S1, S1, S1}, {S0, S0, S0}, {R, R, R}}) {
        const std::string suffix = to_string(pl[0]) + to_string(pl[1]) + to_string(pl[2]);
        n.add(check_op(
            mesh, "repeat_interleave " + suffix,
            [](const std::vector<at::Tensor>& x) {
              return std::vector<at::Tensor>{at::scaled_dot_product_attention(
                  x[0], x[1].repeat_interleave(2, 1), x[2].repeat_interleave(2, 1))};
            },
            {q, k, v}, pl));
        n.add(check_op(
            mesh, "expand + reshape " + suffix,
            [](const std::vector<at::Tensor>& x) {
              auto rep = [](const at::Tensor& t) {
                return t.unsqueeze(2).expand({2, 2, 2, 5, 6}).reshape({2, 4, 5, 6});
              };
              return std::vector<at::Tensor>{
                  at::scaled_dot_product_attention(x[0], rep(x[1]), rep(x[2]))};
            },
            {q, k, v}, pl));
      }
      n.expect_cases(3 * 2, rank, c10::str("repeated key/value heads, world ", world));
    });
  }
}

// CPU stand-ins for the CUDA attention kernels, built on the CPU flash kernel and returning
// what the CUDA kernels return (layouts, float32 logsumexp, RNG state, undefined tensors), so
// that their sharding rules run forward and backward here. They exist in this binary only.
namespace cuda_standins {

using torch::jit::Stack;

at::Tensor like_layout(const at::Tensor& like, const at::Tensor& value) {
  return at::empty_like(like).copy_(value);
}

// (B, H, L, D) values laid out as (B, L, H, D), as the efficient-attention kernel returns them.
at::Tensor bshd(const at::Tensor& value) {
  return at::empty({value.size(0), value.size(2), value.size(1), value.size(3)}, value.options())
      .transpose(1, 2)
      .copy_(value);
}

// The CPU backward wants logsumexp (B, H, L) in q's dtype laid out as (B, L, H).
at::Tensor cpu_lse(const at::Tensor& lse, const at::Tensor& q) {
  return at::empty({lse.size(0), lse.size(2), lse.size(1)}, q.options()).transpose(1, 2).copy_(lse);
}

std::optional<at::Tensor> opt_tensor(const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  const at::Tensor& t = v.toTensor();
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

std::optional<double> opt_double(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::optional<double>(v.toDouble());
}

// q, k, v, dropout_p, is_causal, return_debug_mask, scale
void flash(const c10::OperatorHandle&, Stack* st) {
  auto a = torch::jit::pop(*st, 7);
  const at::Tensor &q = a[0].toTensor(), &k = a[1].toTensor(), &v = a[2].toTensor();
  auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q, k, v, a[3].toDouble(), a[4].toBool(), std::nullopt, opt_double(a[6]));
  TORCH_CHECK(!a[5].toBool(), "stand-in: no debug mask");
  torch::jit::push(*st, like_layout(q, o), lse.to(at::kFloat).contiguous(), at::Tensor(),
                   at::Tensor(), q.size(2), k.size(2), at::zeros({2}, at::kUInt64),
                   at::zeros({}, at::kUInt64), at::empty({0}, q.options()));
}

// grad_out, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
// is_causal, philox_seed, philox_offset, scale
void flash_backward(const c10::OperatorHandle&, Stack* st) {
  auto a = torch::jit::pop(*st, 15);
  const at::Tensor &q = a[1].toTensor(), &k = a[2].toTensor(), &v = a[3].toTensor();
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      a[0].toTensor(), q, k, v, a[4].toTensor(), cpu_lse(a[5].toTensor(), q), a[10].toDouble(),
      a[11].toBool(), std::nullopt, opt_double(a[14]));
  torch::jit::push(*st, like_layout(q, gq), like_layout(k, gk), like_layout(v, gv));
}

// q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale
void efficient(const c10::OperatorHandle&, Stack* st) {
  auto a = torch::jit::pop(*st, 8);
  const at::Tensor &q = a[0].toTensor(), &k = a[1].toTensor(), &v = a[2].toTensor();
  auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q, k, v, a[5].toDouble(), a[6].toBool(), opt_tensor(a[3]), opt_double(a[7]));
  const int64_t L = q.size(2), padded = a[4].toBool() ? (L + 31) / 32 * 32 : 0;
  auto lse_out = at::zeros({q.size(0), q.size(1), padded}, q.options().dtype(at::kFloat));
  if (padded > 0) lse_out.narrow(2, 0, L).copy_(lse);
  torch::jit::push(*st, bshd(o), lse_out, at::zeros({}, at::kLong), at::zeros({}, at::kLong));
}

// grad_out_, q, k, v, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
// grad_input_mask, is_causal, scale
void efficient_backward(const c10::OperatorHandle&, Stack* st) {
  auto a = torch::jit::pop(*st, 13);
  const at::Tensor &q = a[1].toTensor(), &k = a[2].toTensor(), &v = a[3].toTensor();
  TORCH_CHECK(!a[10].toBoolList().get(3), "stand-in: no attention-bias gradient");
  auto lse = cpu_lse(a[6].toTensor().narrow(2, 0, q.size(2)), q);
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      a[0].toTensor(), q, k, v, a[5].toTensor(), lse, a[9].toDouble(), a[11].toBool(),
      opt_tensor(a[4]), opt_double(a[12]));
  torch::jit::push(*st, bshd(gq), bshd(gk), bshd(gv), at::Tensor());
}

// q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, scale
void cudnn(const c10::OperatorHandle&, Stack* st) {
  auto a = torch::jit::pop(*st, 9);
  const at::Tensor &q = a[0].toTensor(), &k = a[1].toTensor(), &v = a[2].toTensor();
  auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q, k, v, a[5].toDouble(), a[6].toBool(), opt_tensor(a[3]), opt_double(a[8]));
  torch::jit::push(*st, like_layout(q, o), lse.to(at::kFloat).unsqueeze(-1).contiguous(),
                   at::Tensor(), at::Tensor(), q.size(2), k.size(2), at::zeros({}, at::kLong),
                   at::zeros({}, at::kLong), at::Tensor());
}

// grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
// cum_seq_k, max_q, max_k, dropout_p, is_causal, scale
void cudnn_backward(const c10::OperatorHandle&, Stack* st) {
  auto a = torch::jit::pop(*st, 16);
  const at::Tensor &q = a[1].toTensor(), &k = a[2].toTensor(), &v = a[3].toTensor();
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      a[0].toTensor(), q, k, v, a[4].toTensor(), cpu_lse(a[5].toTensor().squeeze(-1), q),
      a[13].toDouble(), a[14].toBool(), opt_tensor(a[8]), opt_double(a[15]));
  torch::jit::push(*st, like_layout(q, gq), like_layout(k, gk), like_layout(v, gv));
}

TORCH_LIBRARY_IMPL(aten, CPU, m) {
  m.impl("_scaled_dot_product_flash_attention",
         torch::CppFunction::makeFromBoxedFunction<&flash>());
  m.impl("_scaled_dot_product_flash_attention_backward",
         torch::CppFunction::makeFromBoxedFunction<&flash_backward>());
  m.impl("_scaled_dot_product_efficient_attention",
         torch::CppFunction::makeFromBoxedFunction<&efficient>());
  m.impl("_scaled_dot_product_efficient_attention_backward",
         torch::CppFunction::makeFromBoxedFunction<&efficient_backward>());
  m.impl("_scaled_dot_product_cudnn_attention",
         torch::CppFunction::makeFromBoxedFunction<&cudnn>());
  m.impl("_scaled_dot_product_cudnn_attention_backward",
         torch::CppFunction::makeFromBoxedFunction<&cudnn_backward>());
}

}  // namespace cuda_standins

// The CUDA kernels' rules (through the stand-ins above), forward and backward, against the
// same stand-ins on one device. 7 heads and 7 batch elements leave no rank empty on 1-4 ranks.
TEST(AttentionSweep, CudaKernelRulesMatchOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      at::manual_seed(17);
      auto mesh = init_device_mesh("cpu", {world});
      auto rnd = [](c10::IntArrayRef s) { return at::randn(s, at::kFloat); };
      const auto q = rnd({7, 7, 5, 8}), k = rnd({7, 7, 6, 8}), v = rnd({7, 7, 6, 8});
      const auto bias = rnd({7, 7, 5, 6}), bias2d = rnd({5, 6});
      const OpCheckOptions opts{
          .rtol = 1e-5, .atol = 1e-5, .requires_grad = {true, true, true, false}};
      const std::vector<std::pair<std::string, OpFn>> ops = {
          {"flash",
           [](const std::vector<at::Tensor>& x) {
             return std::vector<at::Tensor>{
                 std::get<0>(at::_scaled_dot_product_flash_attention(x[0], x[1], x[2]))};
           }},
          {"flash causal",
           [](const std::vector<at::Tensor>& x) {
             auto r = at::_scaled_dot_product_flash_attention(x[0], x[1], x[2], 0.0, true);
             return std::vector<at::Tensor>{std::get<0>(r), std::get<1>(r)};
           }},
          {"efficient",
           [](const std::vector<at::Tensor>& x) {
             auto r =
                 at::_scaled_dot_product_efficient_attention(x[0], x[1], x[2], std::nullopt, true);
             return std::vector<at::Tensor>{std::get<0>(r)};
           }},
          {"efficient with bias",
           [](const std::vector<at::Tensor>& x) {
             return std::vector<at::Tensor>{std::get<0>(
                 at::_scaled_dot_product_efficient_attention(x[0], x[1], x[2], x[3], true))};
           }},
          {"cudnn",
           [](const std::vector<at::Tensor>& x) {
             auto r = at::_scaled_dot_product_cudnn_attention(x[0], x[1], x[2], std::nullopt, true,
                                                              0.0, true);
             return std::vector<at::Tensor>{std::get<0>(r), std::get<1>(r)};
           }},
          {"cudnn with bias",
           [](const std::vector<at::Tensor>& x) {
             return std::vector<at::Tensor>{std::get<0>(
                 at::_scaled_dot_product_cudnn_attention(x[0], x[1], x[2], x[3], true))};
           }},
      };
      const Placements R{Replicate()}, S0{Shard(0)}, S1{Shard(1)}, S2{Shard(2)};
      SweepCounter n;
      for (const auto& [name, fn] : ops) {
        const bool with_bias = name.find("bias") != std::string::npos;
        for (const auto& m : with_bias ? std::vector<at::Tensor>{bias, bias2d}
                                       : std::vector<at::Tensor>{at::Tensor()}) {
          for (const auto& pl : std::vector<std::vector<Placements>>{
                   {R, R, R}, {S1, S1, S1}, {S0, S0, S0}, {S2, S1, R}}) {
            std::vector<at::Tensor> in{q, k, v};
            auto placements = pl;
            if (with_bias) {
              in.push_back(m);
              placements.push_back(m.dim() == 4 ? pl[0] : R);
            }
            const std::string label = name + " " + to_string(pl[0]) + to_string(pl[1]) +
                                      to_string(pl[2]) +
                                      (with_bias ? " bias " + c10::str(m.sizes()) : "");
            n.add(check_op(mesh, label, fn, in, placements, opts));
          }
        }
      }
      // Heads split in, heads split out, no communication.
      for (const auto& [name, fn] : ops) {
        std::vector<at::Tensor> in;
        for (const auto& t : {q, k, v, bias}) in.push_back(distribute_tensor(t, mesh, {Shard(1)}));
        CommDebugMode comm;
        for (const auto& out : fn(in)) EXPECT_EQ(placements(out)[0], Shard(1)) << name;
        EXPECT_EQ(comm.get_total_counts(), 0) << name << "\n" << comm.table();
      }
      // 4 layouts for each of the 4 ops without a bias and each of 2 biases of the 2 with one.
      n.expect_cases(4 * 4 + 2 * 2 * 4, rank,
                     c10::str("CUDA attention rules via CPU stand-ins, world ", world));
    });
  }
}
