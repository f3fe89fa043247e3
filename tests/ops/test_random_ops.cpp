// Random ops on DTensors draw from DTensor's counter-based stream: replicas draw equal numbers,
// shards disjoint ones, the full tensor equals the single-device draw for the same seed, and
// every rank's stream stays in step. Dropout forward/backward and p = 0.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

constexpr uint64_t kSeed = 2024;

int64_t numel_of(c10::IntArrayRef s) {
  int64_t n = 1;
  for (auto x : s) n *= x;
  return n;
}

// The single-device draws of DTensor's stream (after dtensor::manual_seed).
at::Tensor ref_uniform(c10::IntArrayRef shape) {
  return random::uniform_block(random::reserve(numel_of(shape)), shape, shape,
                               std::vector<int64_t>(shape.size(), 0), at::kDouble);
}
at::Tensor ref_normal(c10::IntArrayRef shape) {
  return random::normal_block(random::reserve(numel_of(shape)), shape, shape,
                              std::vector<int64_t>(shape.size(), 0), at::kDouble);
}

using Outputs = std::vector<at::Tensor>;

struct RandomOp {
  std::string name;
  bool inplace;                                   // cannot take a Partial input
  std::function<Outputs(const at::Tensor&)> run;  // on the input (DTensor or global)
  std::function<Outputs(const at::Tensor&)> ref;  // single-device stream reference
};

std::vector<RandomOp> random_ops() {
  auto cl = [](const at::Tensor& x) { return x.detach().clone(); };
  return {
      {"uniform_", true, [=](const at::Tensor& x) { return Outputs{cl(x).uniform_(-2, 3)}; },
       [](const at::Tensor& x) { return Outputs{ref_uniform(x.sizes()) * 5 - 2}; }},
      {"normal_", true, [=](const at::Tensor& x) { return Outputs{cl(x).normal_(0.5, 2)}; },
       [](const at::Tensor& x) { return Outputs{ref_normal(x.sizes()) * 2 + 0.5}; }},
      {"bernoulli_", true, [=](const at::Tensor& x) { return Outputs{cl(x).bernoulli_(0.3)}; },
       [](const at::Tensor& x) { return Outputs{ref_uniform(x.sizes()).lt(0.3).to(at::kDouble)}; }},
      {"bernoulli_tensor_p", true,
       [=](const at::Tensor& x) { return Outputs{cl(x).bernoulli_(x.select(0, 0).sigmoid())}; },
       [](const at::Tensor& x) {
         return Outputs{ref_uniform(x.sizes()).lt(x.select(0, 0).sigmoid()).to(at::kDouble)};
       }},
      {"bernoulli_p", false, [](const at::Tensor& x) { return Outputs{at::bernoulli(x, 0.6)}; },
       [](const at::Tensor& x) { return Outputs{ref_uniform(x.sizes()).lt(0.6).to(at::kDouble)}; }},
      {"bernoulli_probs", false,
       [](const at::Tensor& x) { return Outputs{at::bernoulli(x.sigmoid())}; },
       [](const at::Tensor& x) {
         return Outputs{ref_uniform(x.sizes()).lt(x.sigmoid()).to(at::kDouble)};
       }},
      {"rand_like", false, [](const at::Tensor& x) { return Outputs{at::rand_like(x)}; },
       [](const at::Tensor& x) { return Outputs{ref_uniform(x.sizes())}; }},
      {"rand_like_float", false,
       [](const at::Tensor& x) { return Outputs{at::rand_like(x, at::kFloat)}; },
       [](const at::Tensor& x) { return Outputs{ref_uniform(x.sizes()).to(at::kFloat)}; }},
      {"randn_like", false, [](const at::Tensor& x) { return Outputs{at::randn_like(x)}; },
       [](const at::Tensor& x) { return Outputs{ref_normal(x.sizes())}; }},
      {"randint_like", false, [](const at::Tensor& x) { return Outputs{at::randint_like(x, 10)}; },
       [](const at::Tensor& x) { return Outputs{(ref_uniform(x.sizes()) * 10).floor()}; }},
      {"randint_like_low", false,
       [](const at::Tensor& x) { return Outputs{at::randint_like(x, -3, 4)}; },
       [](const at::Tensor& x) { return Outputs{(ref_uniform(x.sizes()) * 7).floor() - 3}; }},
      {"native_dropout", false,
       [](const at::Tensor& x) {
         auto [out, mask] = at::native_dropout(x, 0.3, true);
         return Outputs{out, mask};
       },
       [](const at::Tensor& x) {
         auto mask = ref_uniform(x.sizes()).lt(0.7);
         return Outputs{x * mask * (1 / 0.7), mask};
       }},
      {"dropout", false, [](const at::Tensor& x) { return Outputs{at::dropout(x, 0.4, true)}; },
       [](const at::Tensor& x) {
         return Outputs{x * (ref_uniform(x.sizes()).lt(0.6).to(at::kDouble) / 0.6)};
       }},
  };
}

// `x` laid out as `p` (a Partial holds x / n on every rank).
at::Tensor place(const at::Tensor& x, const DeviceMesh& mesh, const Placements& p) {
  int64_t parts = 1;
  bool partial = false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i].is_partial()) parts *= mesh.size(static_cast<int64_t>(i));
    partial |= p[i].is_partial();
  }
  if (!partial) return distribute_tensor(x, mesh, p);
  auto base = distribute_tensor(x, mesh, clear_partial(p));
  return from_local(local_tensor(base) / parts, mesh, p,
                    {.shape = x.sizes().vec(), .stride = x.strides().vec()});
}

// Runs every op with every layout, checking values against the single-device stream and that
// the stream is in step afterwards (the next draw agrees too).
SweepCounter check_all_layouts(const DeviceMesh& mesh, const std::vector<Placements>& layouts,
                               const std::vector<std::vector<int64_t>>& shapes) {
  SweepCounter n;
  for (const auto& shape : shapes) {
    // Own generator: every rank builds the same inputs whatever ran before.
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(numel_of(shape)));
    const auto x = at::randn(shape, gen, at::kDouble);
    for (const auto& op : random_ops()) {
      for (const auto& p : layouts) {
        bool partial = false;
        for (const auto& q : p) partial |= q.is_partial();
        if (partial && op.inplace) continue;
        const std::string label = op.name + " " + to_string(p) + " " + c10::str(x.sizes());
        SCOPED_TRACE(label);
        const auto dx = place(x, mesh, p);
        manual_seed(kSeed);
        const Outputs out = op.run(dx);
        const auto next = rand_global({3}, at::kDouble);
        manual_seed(kSeed);
        const Outputs ref = op.ref(x);
        const auto ref_next = rand_global({3}, at::kDouble);
        EXPECT_EQ(out.size(), ref.size());
        bool ok = out.size() == ref.size();
        for (size_t k = 0; k < std::min(out.size(), ref.size());
             ++k) {  // same collectives on every rank
          EXPECT_TRUE(is_dtensor(out[k]));
          const at::Tensor full = full_tensor(out[k]);
          auto r = tensors_close(full, ref[k], 1e-10, 1e-10);
          EXPECT_TRUE(r) << "output " << k;
          EXPECT_EQ(full.scalar_type(), ref[k].scalar_type()) << "output " << k;
          ok &= r && full.scalar_type() == ref[k].scalar_type();
        }
        EXPECT_TENSOR_EQ(next, ref_next);
        n.add(ok && next.equal(ref_next));
      }
    }
  }
  return n;
}

}  // namespace

TEST(RandomOps, EveryLayoutDrawsTheSingleDeviceStream) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      const std::vector<Placements> layouts = {{Replicate()}, {Shard(0)}, {Shard(1)}, {Partial()}};
      // 3 shapes x (13 ops x 4 layouts, less the 4 in-place ops on the Partial one).
      check_all_layouts(mesh, layouts, {{4, 6}, {5, 3}, {2, 7}})
          .expect_cases(3 * (13 * 4 - 4), rank, c10::str("random ops, world ", world));
    });
  }
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    const std::vector<Placements> layouts = {{Shard(0), Shard(1)},
                                             {Replicate(), Shard(0)},
                                             {Shard(1), Replicate()},
                                             {Shard(0), Shard(0)},
                                             {Partial(), Shard(1)}};
    // 2 shapes x (13 ops x 5 layouts, less the 4 in-place ops on the Partial one).
    check_all_layouts(mesh, layouts, {{4, 6}, {5, 3}})
        .expect_cases(2 * (13 * 5 - 4), rank, "random ops, 2x2 mesh");
  });
}

// The sweeps above compare against the stream's own single-device draws (ref_uniform,
// ref_normal); these check those draws against the distributions they stand for, so a broken
// generator (constant, shifted, badly scaled) fails here rather than agreeing with itself.
// 10,000 draws from a fixed seed; each bound is about 4 standard errors.
TEST(RandomOps, SingleDeviceReferenceDrawsHaveTheirDistributions) {
  manual_seed(kSeed);
  const auto u = ref_uniform({100, 100});
  EXPECT_GE(u.min().item<double>(), 0.0);
  EXPECT_LT(u.max().item<double>(), 1.0);
  EXPECT_NEAR(u.mean().item<double>(), 0.5, 0.012);
  EXPECT_NEAR(u.var().item<double>(), 1.0 / 12, 0.004);
  const auto z = ref_normal({100, 100});
  EXPECT_NEAR(z.mean().item<double>(), 0.0, 0.04);
  EXPECT_NEAR(z.std().item<double>(), 1.0, 0.03);
  // Successive draws continue the stream instead of repeating it.
  EXPECT_FALSE(ref_uniform({100}).equal(ref_uniform({100})));
}

TEST(RandomOps, ReplicasDrawEqualMasksAndShardsDisjointOnes) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      const auto x = at::randn({4 * world, 32}, at::kDouble);
      manual_seed(kSeed);
      auto [rout, rmask] = at::native_dropout(distribute_tensor(x, mesh, {Replicate()}), 0.5, true);
      manual_seed(kSeed);
      const auto mask_ref = ref_uniform(x.sizes()).lt(0.5);
      // Every replica holds the whole single-device mask (no communication involved).
      EXPECT_TENSOR_EQ(local_tensor(rmask), mask_ref);
      manual_seed(kSeed);
      auto [sout, smask] = at::native_dropout(distribute_tensor(x, mesh, {Shard(0)}), 0.5, true);
      EXPECT_TENSOR_EQ(local_tensor(smask), mask_ref.chunk(world, 0)[rank]);
      auto full = full_tensor(smask);
      EXPECT_TENSOR_EQ(full, mask_ref);
      const auto blocks = full.chunk(world, 0);
      for (int i = 0; i < world; ++i) {
        for (int j = i + 1; j < world; ++j)
          EXPECT_FALSE(blocks[i].equal(blocks[j])) << i << " vs " << j;
      }
      // Uniform values of different shards are disjoint draws, not copies.
      manual_seed(kSeed);
      auto u = full_tensor(at::rand_like(distribute_tensor(x, mesh, {Shard(1)})));
      for (int i = 0; i < world; ++i) {
        for (int j = i + 1; j < world; ++j) {
          EXPECT_FALSE(u.chunk(world, 1)[i].equal(
              u.chunk(world, 1)[j].slice(1, 0, u.chunk(world, 1)[i].size(1))));
        }
      }
      if (rank == 0)
        std::printf("[sweep] dropout mask layouts, world %d: 3 (op, case) combinations\n", world);
    });
  }
}

TEST(RandomOps, DropoutForwardBackwardMatchesTheSameSeedOnOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      for (auto shape : std::vector<std::vector<int64_t>>{{4, 6}, {5, 3}}) {
        const auto x = at::randn(shape, at::kDouble);
        const auto w = at::randn(shape, at::kDouble);
        for (const auto& p :
             std::vector<Placements>{{Replicate()}, {Shard(0)}, {Shard(1)}, {Partial()}}) {
          for (bool fused : {true, false}) {
            SCOPED_TRACE(std::string(fused ? "native_dropout " : "dropout ") + to_string(p));
            const double drop = 0.25;
            auto dx = place(x, mesh, p).detach().requires_grad_(true);
            manual_seed(kSeed + 1);
            auto out = fused ? std::get<0>(at::native_dropout(dx, drop, true))
                             : at::dropout(dx, drop, true);
            if (fused && p[0].is_partial()) {
              EXPECT_EQ(placements(out)[0], Partial());  // kept: no all-reduce
            }
            (out * distribute_tensor(w, mesh, {Replicate()})).sum().backward();
            manual_seed(kSeed + 1);
            const auto scale = ref_uniform(x.sizes()).lt(1 - drop).to(at::kDouble) / (1 - drop);
            auto r1 = tensors_close(full_tensor(out), x * scale, 1e-10, 1e-10);
            auto r2 = tensors_close(full_tensor(dx.grad()), w * scale, 1e-10, 1e-10);
            EXPECT_TRUE(r1);
            EXPECT_TRUE(r2);
            n.add(r1 && r2);
          }
        }
        // p = 0 is the identity (and dropout outside training too).
        for (const auto& p : std::vector<Placements>{{Replicate()}, {Shard(0)}, {Partial()}}) {
          auto dx = place(x, mesh, p);
          // The local values are returned unchanged; a Partial's parts sum up to x within rounding.
          const at::Tensor expect = full_tensor(dx);
          auto [out, mask] = at::native_dropout(dx, 0.0, true);
          EXPECT_TENSOR_EQ(full_tensor(out), expect);
          EXPECT_TRUE(full_tensor(mask).all().item<bool>());
          EXPECT_TENSOR_EQ(full_tensor(at::dropout(dx, 0.0, true)), expect);
          auto [eval_out, eval_mask] = at::native_dropout(dx, 0.5, false);
          EXPECT_TENSOR_EQ(full_tensor(eval_out), expect);
          EXPECT_TRUE(full_tensor(eval_mask).all().item<bool>());
          EXPECT_TENSOR_CLOSE(expect, x, 1e-12, 1e-12);
          n.add(!::testing::Test::HasFailure());
        }
      }
      // 2 shapes x (4 layouts x fused or not + 3 layouts with p = 0).
      n.expect_cases(2 * (4 * 2 + 3), rank, c10::str("dropout fwd/bwd and p=0, world ", world));
    });
  }
}

TEST(RandomOps, InPlaceDrawIntoPartialIsRefused) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto p = from_local(at::ones({4}), mesh, {Partial()});
    EXPECT_ERROR(p.uniform_(), c10::Error, "aten::uniform_", "P(sum)", "redistribute");
  });
}
