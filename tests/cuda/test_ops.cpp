// DTensor on CUDA tensors: every op family, redistribution between all placements and the
// tensor-parallel styles, in float32 and bfloat16, at 1 rank over NCCL and at 2 ranks sharing
// the one GPU over Gloo; each compared with the same computation on one GPU (forward and
// backward). Skipped where no GPU is visible; scripts/gpu-check runs them on a GPU machine.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/normalization.h>

#include "dtensor/dtensor.h"
#include "support/cuda.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

struct DtypeCase {
  at::ScalarType dtype;
  double rtol, atol;
};

// float32: sharded sums add in another order (a few ulp of 2^-24 over tens of terms).
// bfloat16 keeps 8 significant bits: an output of a few units rounds by up to 2^-8 relative,
// and reduction orders differ by that much per term.
const DtypeCase kDtypes[] = {{at::kFloat, 1e-4, 1e-4}, {at::kBFloat16, 3e-2, 6e-2}};

std::string dtype_name(at::ScalarType t) { return t == at::kFloat ? "float32" : "bfloat16"; }

at::Tensor cuda_randn(c10::IntArrayRef shape, at::ScalarType dtype) {
  // Drawn on the CPU from run_ranks' common seed: the same values on every rank.
  return at::randn(shape, at::kFloat).to(at::kCUDA).to(dtype);
}

struct Case {
  std::string name;
  OpFn fn;
  std::vector<at::Tensor> inputs;
  bool with_partial = true;  // also Partial float inputs (linear ops)
};

OpFn one(std::function<at::Tensor(const std::vector<at::Tensor>&)> f) {
  return [f](const std::vector<at::Tensor>& x) { return std::vector<at::Tensor>{f(x)}; };
}

// One representative or two of each op family the dispatcher has rules for.
std::vector<Case> op_cases(at::ScalarType dt) {
  auto r = [dt](c10::IntArrayRef s) { return cuda_randn(s, dt); };
  const auto idx = at::randint(12, {4, 6}, at::kLong).to(at::kCUDA);
  const auto target = at::randint(10, {8}, at::kLong).to(at::kCUDA);
  return {
      // pointwise
      {"add", one([](auto& x) { return x[0] + x[1]; }), {r({8, 6}), r({8, 6})}},
      {"mul", one([](auto& x) { return x[0] * x[1]; }), {r({8, 6}), r({8, 6})}, false},
      {"gelu", one([](auto& x) { return at::gelu(x[0]); }), {r({8, 6})}, false},
      {"silu * x",
       one([](auto& x) { return at::silu(x[0]) * x[1]; }),
       {r({6, 8}), r({6, 8})},
       false},
      // reductions
      {"sum", one([](auto& x) { return x[0].sum(); }), {r({8, 6})}},
      {"sum dim 0", one([](auto& x) { return x[0].sum(0); }), {r({8, 6})}},
      {"mean dim -1", one([](auto& x) { return x[0].mean(-1); }), {r({8, 6})}},
      {"amax dim 1", one([](auto& x) { return x[0].amax(1); }), {r({8, 6})}, false},
      // matrix products
      {"mm", one([](auto& x) { return at::mm(x[0], x[1]); }), {r({8, 6}), r({6, 4})}},
      {"addmm",
       one([](auto& x) { return at::addmm(x[0], x[1], x[2]); }),
       {r({4}), r({8, 6}), r({6, 4})},
       false},
      {"bmm", one([](auto& x) { return at::bmm(x[0], x[1]); }), {r({4, 3, 6}), r({4, 6, 2})}},
      {"linear",
       one([](auto& x) { return at::linear(x[0], x[1], x[2]); }),
       {r({2, 4, 8}), r({6, 8}), r({6})},
       false},
      // softmax and norms
      {"softmax", one([](auto& x) { return at::softmax(x[0], -1); }), {r({8, 6})}, false},
      {"log_softmax dim 0",
       one([](auto& x) { return at::log_softmax(x[0], 0); }),
       {r({8, 6})},
       false},
      {"layer_norm",
       one([](auto& x) { return at::layer_norm(x[0], {8}, x[1], x[2], 1e-5); }),
       {r({4, 6, 8}), r({8}), r({8})},
       false},
      {"rms_norm",
       one([](auto& x) { return at::rms_norm(x[0], {8}, x[1], 1e-5); }),
       {r({4, 6, 8}), r({8})},
       false},
      // embedding, loss
      {"embedding",
       one([](auto& x) { return at::embedding(x[0], x[1]); }),
       {r({12, 8}), idx},
       false},
      {"cross_entropy",
       one([](auto& x) { return at::cross_entropy_loss(x[0], x[1]); }),
       {r({8, 10}), target},
       false},
      // views, concatenation, slicing
      {"view + transpose",
       one([](auto& x) {
         return x[0].view({4, 2, 6}).transpose(1, 2).contiguous();
       }),
       {r({8, 6})}},
      {"cat dim 1",
       one([](auto& x) {
         return at::cat({x[0], x[1]}, 1);
       }),
       {r({8, 6}), r({8, 2})}},
      {"narrow", one([](auto& x) { return x[0].narrow(1, 1, 3); }), {r({8, 6})}},
  };
}

// Attention on (B, H, L, D): the flash (bfloat16) and memory-efficient (float32) CUDA kernels.
std::vector<Case> attention_cases(at::ScalarType dt) {
  auto r = [dt](c10::IntArrayRef s) { return cuda_randn(s, dt); };
  std::vector<Case> out;
  for (bool causal : {false, true}) {
    out.push_back({std::string("scaled_dot_product_attention") + (causal ? " causal" : ""),
                   one([causal](auto& x) {
                     return at::scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.0, causal);
                   }),
                   {r({2, 4, 8, 16}), r({2, 4, 8, 16}), r({2, 4, 8, 16})},
                   false});
  }
  return out;
}

// Every placement combination of every case, all of which must pass. `attention`: q, k and v
// are laid out alike, replicated or sharded on batch or heads (the rules' parallel dims).
void sweep(const DeviceMesh& mesh, const std::vector<Case>& cases, const DtypeCase& d,
           bool attention, int rank, const std::string& what) {
  SweepCounter n;
  int64_t expected = 0;
  OpCheckOptions o;
  o.rtol = d.rtol;
  o.atol = d.atol;
  o.layout = !attention;  // the CUDA attention kernels choose their output strides
  for (const auto& c : cases) {
    std::vector<std::vector<Placements>> layouts;
    if (attention) {
      for (const Placements& p : std::vector<Placements>{{Replicate()}, {Shard(0)}, {Shard(1)}}) {
        layouts.push_back({p, p, p});
      }
      expected += 3;
    } else {
      std::vector<std::vector<Placements>> per_input;
      int64_t product = 1;
      for (const auto& t : c.inputs) {
        per_input.push_back(placements_1d(t.dim(), c.with_partial && t.is_floating_point()));
        product *= static_cast<int64_t>(per_input.back().size());
      }
      layouts = combinations(per_input);
      expected += product;
    }
    for (const auto& pl : layouts) {
      std::string label = c.name + " " + dtype_name(d.dtype);
      for (const auto& q : pl) label += " " + to_string(q);
      n.add(check_op(mesh, label, c.fn, c.inputs, pl, o));
    }
  }
  n.expect_cases(expected, rank, what + " " + dtype_name(d.dtype));
  EXPECT_EQ(n.failures, 0);
}

}  // namespace

TEST(CudaOps, EveryOpFamilyMatchesOneGpu) {
  SKIP_WITHOUT_CUDA();
  for (const auto& s : cuda_settings()) {
    run_cuda_ranks(s, [&](int rank) {
      auto mesh = init_device_mesh("cuda", {s.world_size});
      ASSERT_EQ(mesh.device().type(), c10::DeviceType::CUDA);
      for (const auto& d : kDtypes) {
        sweep(mesh, op_cases(d.dtype), d, false, rank, "cuda ops, " + s.name);
      }
    });
  }
}

TEST(CudaOps, AttentionMatchesOneGpu) {
  SKIP_WITHOUT_CUDA();
  for (const auto& s : cuda_settings()) {
    run_cuda_ranks(s, [&](int rank) {
      auto mesh = init_device_mesh("cuda", {s.world_size});
      for (const auto& d : kDtypes) {
        sweep(mesh, attention_cases(d.dtype), d, true, rank, "cuda attention, " + s.name);
      }
    });
  }
}

// From each of R, S(0), S(1), P to each of R, S(0), S(1) on an uneven tensor: all-gather, reduce-scatter,
// all-to-all, all-reduce and local chunking on CUDA tensors, the values exact.
TEST(CudaOps, RedistributeFromEveryPlacementToEveryPublicTargetIsExact) {
  SKIP_WITHOUT_CUDA();
  for (const auto& s : cuda_settings()) {
    run_cuda_ranks(s, [&](int) {
      auto mesh = init_device_mesh("cuda", {s.world_size});
      const std::vector<Placements> all = {{Replicate()}, {Shard(0)}, {Shard(1)}, {Partial()}};
      // Partial is a source only: redistribute refuses it as a target, as PyTorch does.
      const std::vector<Placements> targets(all.begin(), all.end() - 1);
      for (const auto& d : kDtypes) {
        // Small integers: every sum is exact in bfloat16 too.
        const auto x = at::randint(-8, 8, {5, 6}, at::kFloat).to(at::kCUDA).to(d.dtype);
        int cases = 0;
        for (const auto& from : all) {
          for (const auto& to : targets) {
            SCOPED_TRACE(dtype_name(d.dtype) + " " + to_string(from) + " -> " + to_string(to));
            at::Tensor dt;
            if (from[0].is_partial()) {
              // Rank 0 holds x, the others zeros: the pending sum is x.
              const bool first = mesh.get_local_rank() == 0;
              dt = from_local(first ? x.clone() : at::zeros_like(x), mesh, from);
            } else {
              dt = distribute_tensor(x, mesh, from, std::nullopt);
            }
            auto moved = redistribute(dt, mesh, to);
            EXPECT_TRUE(local_tensor(moved).is_cuda());
            EXPECT_TRUE(at::equal(full_tensor(moved).cpu(), x.cpu()));
            ++cases;
          }
        }
        EXPECT_EQ(cases, 12);
      }
    });
  }
}

// Colwise then rowwise Linear (the MLP of PyTorch's TP tutorial) behind a sequence-parallel
// LayerNorm, forward and backward, against the same modules on one GPU.
TEST(CudaOps, TensorParallelStylesMatchOneGpu) {
  SKIP_WITHOUT_CUDA();
  for (const auto& s : cuda_settings()) {
    run_cuda_ranks(s, [&](int rank) {
      const int64_t world = s.world_size;
      auto mesh = init_device_mesh("cuda", {world});
      for (const auto& d : kDtypes) {
        SCOPED_TRACE(dtype_name(d.dtype));
        auto make = [&] {
          at::manual_seed(7);
          auto norm = dtensor::nn::LayerNorm(torch::nn::LayerNormOptions({16}));
          auto fc1 = dtensor::nn::Linear(16, 32);
          auto fc2 = dtensor::nn::Linear(32, 16);
          for (torch::nn::Module* m :
               std::vector<torch::nn::Module*>{norm.get(), fc1.get(), fc2.get()}) {
            m->to(at::kCUDA, d.dtype);
          }
          return std::make_tuple(norm, fc1, fc2);
        };
        auto [rnorm, rfc1, rfc2] = make();
        auto [norm, fc1, fc2] = make();
        tp::parallelize_module(*norm, mesh, tp::SequenceParallel());
        tp::parallelize_module(*fc1, mesh, tp::ColwiseParallel({.input_layouts = Shard(1)}));
        tp::parallelize_module(*fc2, mesh, tp::RowwiseParallel({.output_layouts = Shard(1)}));
        const auto x = cuda_randn({2, 4 * world, 16}, d.dtype);
        auto xr = x.clone().requires_grad_(true);
        auto yr = rfc2(at::gelu(rfc1(rnorm(xr))));
        // Each rank feeds its sequence shard, as sequence parallelism does between blocks.
        auto xd = x.chunk(world, 1)[rank].clone().requires_grad_(true);
        auto yd = fc2(at::gelu(fc1(norm(xd))));
        ASSERT_TRUE(yd.is_cuda());
        EXPECT_TENSOR_CLOSE(yd, yr.chunk(world, 1)[rank], d.rtol, d.atol);
        const auto w = cuda_randn(yr.sizes(), d.dtype);
        (yr * w).sum().backward();
        (yd * w.chunk(world, 1)[rank]).sum().backward();
        EXPECT_TENSOR_CLOSE(xd.grad(), xr.grad().chunk(world, 1)[rank], d.rtol, d.atol);
        EXPECT_TENSOR_CLOSE(full_tensor(fc1->weight.grad()), rfc1->weight.grad(), d.rtol, d.atol);
        EXPECT_TENSOR_CLOSE(full_tensor(fc2->weight.grad()), rfc2->weight.grad(), d.rtol, d.atol);
        auto norm_grad = norm->weight.grad();
        if (is_dtensor(norm_grad)) norm_grad = full_tensor(norm_grad);
        EXPECT_TENSOR_CLOSE(norm_grad, rnorm->weight.grad(), d.rtol, d.atol);
      }
    });
  }
}
