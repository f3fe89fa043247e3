// A DTensor's strides equal those of the same computation on one device, after every op of a
// transformer's vocabulary applied to permuted inputs (transposes, permutes), with uneven and
// empty shards: values, sizes and strides of every output and gradient (check_op), backward
// from a weighted sum and from a plain sum (whose gradient is a broadcast, every stride 0); and
// seeded random chains of narrows, permutes, reshapes, linears and redistributes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <numeric>
#include <random>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

struct NamedOp {
  std::string name;
  OpFn fn;
};

at::Tensor tr(const at::Tensor& t) { return t.transpose(0, 2); }  // [4,3,5] -> [5,3,4]

// `t` moved to Shard(dim) on the first mesh dim (the others replicated); a plain tensor as it
// is (redistributing does not change the value).
at::Tensor shard_as(const at::Tensor& t, int64_t dim) {
  if (!is_dtensor(t)) return t;
  Placements p(static_cast<size_t>(device_mesh(t).ndim()), Replicate());
  p[0] = Shard(dim);
  return redistribute(t, device_mesh(t), p);
}

// Ops on x ([4, 3, 5]) seen through a transpose or a permute, and, where they take one, a
// second tensor y of the same shape.
std::vector<NamedOp> ops() {
  using V = std::vector<at::Tensor>;
  return {
      {"exp(t)", [](const V& a) { return V{tr(a[0]).exp()}; }},
      {"t * 2 + 1", [](const V& a) { return V{tr(a[0]) * 2 + 1}; }},
      {"relu(t)", [](const V& a) { return V{at::relu(tr(a[0]))}; }},
      {"gelu(t)", [](const V& a) { return V{at::gelu(tr(a[0]))}; }},
      {"sigmoid(t)", [](const V& a) { return V{at::sigmoid(tr(a[0]))}; }},
      {"t + t(y)", [](const V& a) { return V{tr(a[0]) + tr(a[1])}; }},
      {"t * y.permute",
       [](const V& a) {
         return V{tr(a[0]) * a[1].permute({2, 1, 0})};
       }},
      {"t + contiguous t(y)", [](const V& a) { return V{tr(a[0]) + tr(a[1]).contiguous()}; }},
      {"t * row", [](const V& a) { return V{tr(a[0]) * a[1].select(1, 0).select(1, 0)}; }},
      {"where(t > 0, t, t(y))",
       [](const V& a) { return V{at::where(tr(a[0]) > 0, tr(a[0]), tr(a[1]))}; }},
      {"permute + exp",
       [](const V& a) {
         return V{a[0].permute({1, 2, 0}).exp()};
       }},
      {"softmax(t, -1)", [](const V& a) { return V{at::softmax(tr(a[0]), -1)}; }},
      {"log_softmax(t, 0)", [](const V& a) { return V{at::log_softmax(tr(a[0]), 0)}; }},
      {"sum(t, 1)", [](const V& a) { return V{tr(a[0]).sum(1)}; }},
      {"mean(t, -1, keepdim)", [](const V& a) { return V{tr(a[0]).mean(-1, true)}; }},
      {"flatten(t)", [](const V& a) { return V{tr(a[0]).flatten()}; }},
      {"reshape(t)",
       [](const V& a) {
         return V{tr(a[0]).reshape({15, 4})};
       }},
      {"contiguous(t)", [](const V& a) { return V{tr(a[0]).contiguous()}; }},
      {"clone(t)", [](const V& a) { return V{tr(a[0]).clone()}; }},
      {"unsqueeze(t)", [](const V& a) { return V{tr(a[0]).unsqueeze(1) * 3}; }},
      {"narrow(t)", [](const V& a) { return V{tr(a[0]).narrow(1, 1, 2) * 3}; }},
      {"matmul(t, w)", [](const V& a) { return V{at::matmul(tr(a[0]), a[1].select(2, 0))}; }},
      {"linear(t, w)", [](const V& a) { return V{at::linear(tr(a[0]), a[1].select(1, 0).t())}; }},
      {"t.to(float)", [](const V& a) { return V{tr(a[0]).to(at::kFloat).to(at::kDouble)}; }},
      // Narrowed and permuted views before and after ops whose backward reshapes the gradient
      // (linear, flatten), with a redistribute between them.
      {"linear(t, w).permute",
       [](const V& a) {
         return V{at::linear(tr(a[0]), a[1].select(1, 0).t()).permute({0, 2, 1})};
       }},
      {"narrow, permute, linear",
       [](const V& a) {
         return V{at::linear(a[0].narrow(0, 1, 3).permute({0, 2, 1}), a[1].select(2, 0))};
       }},
      {"linear, permute, redistribute",
       [](const V& a) {
         return V{shard_as(at::linear(a[0], a[1].select(1, 0)).permute({2, 1, 0}), 1)};
       }},
      {"narrow, permute, redistribute, flatten",
       [](const V& a) {
         return V{shard_as(a[0].narrow(2, 1, 3).permute({1, 0, 2}), 0).flatten(1) * 2};
       }},
  };
}

constexpr int64_t kOps = 28;  // ops().size()

// `expected_cases`: ops() (kOps) times the layouts the caller meant to generate times the two
// losses, so a layout generator that yields fewer (or none) fails the sweep instead of emptying
// it.
void sweep(const DeviceMesh& mesh, int rank, const std::vector<std::vector<Placements>>& layouts,
           int64_t expected_cases) {
  at::manual_seed(3);
  const auto x = at::randn({4, 3, 5}, at::kDouble);
  const auto y = at::randn({4, 3, 5}, at::kDouble);
  SweepCounter counter;
  // Where a shard's local sizes make the local kernel choose another dim order than the global
  // result has (shards of one row, stride ties), the kernel re-lays the local result out; the
  // count is reported, and a Llama training step asserts it stays 0
  // (test_models_tensor_parallel_plan).
  const int64_t copies_before = dispatch::cache_stats().layout_copies;
  for (const auto& op : ops()) {
    for (const auto& pl : layouts) {
      const std::string label = op.name + " on " + to_string(pl[0]) + ", " + to_string(pl[1]);
      counter.add(check_op(mesh, label, op.fn, {x, y}, pl));
      counter.add(check_op(mesh, label + ", sum loss", op.fn, {x, y}, pl, {.sum_loss = true}));
    }
  }
  const int64_t copies = dispatch::cache_stats().layout_copies - copies_before;
  EXPECT_EQ(counter.failures, 0);
  EXPECT_EQ(counter.cases, expected_cases);
  if (rank == 0) {
    std::printf(
        "[sweep] strides after permuted-input ops on a %s mesh: %ld cases, %ld failures, %ld "
        "local results re-laid out\n",
        c10::str(mesh.shape()).c_str(), (long)counter.cases, (long)counter.failures, (long)copies);
  }
}

}  // namespace

// 3 ranks: dim 0 (4 rows) splits 2, 2, 0; dim 2 (5) splits 2, 2, 1.
TEST(StrideSweep, OneDimMeshesOfTwoAndThreeRanks) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      // x in R, S(0), S(1), S(2) times y in R, S(2): 8 layouts.
      sweep(mesh, rank,
            combinations({placements_1d(3), {Placements{Replicate()}, Placements{Shard(2)}}}),
            kOps * 8 * 2);
    });
  }
}

TEST(StrideSweep, TwoByTwoMesh) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    const std::vector<Placements> x_layouts = {
        {Shard(0), Shard(2)}, {Shard(2), Shard(2)}, {Replicate(), Shard(1)}, {Shard(0), Shard(0)}};
    std::vector<std::vector<Placements>> layouts;
    for (const auto& p : x_layouts) layouts.push_back({p, {Replicate(), Replicate()}});
    layouts.push_back({{Shard(1), Replicate()}, {Shard(0), Shard(2)}});
    sweep(mesh, rank, layouts, kOps * 5 * 2);
  });
}

// The gradient leaving a redistribute carried the strides of the forward input (contiguous)
// while its local tensor kept the layout of the gradient that arrived (a transpose), so the
// next backward view, valid for the global strides, failed on the shard: "view size is not
// compatible with input tensor's size and stride" (aten::view on (S(2))[9, 3, 7]).
TEST(StrideSweep, LinearOfATransposedRedistributedShardMatchesOneDeviceForwardAndBackward) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      using V = std::vector<at::Tensor>;
      // x [9,3,6] S(2), b [6] R, w1 [7,6] S(0), w2 [5,7] R:
      // layer_norm -> + b -> linear(w1) -> redistribute(S(1)) -> transpose(1, 0) -> linear(w2).
      auto chain = [](const V& a) {
        auto h = at::linear(at::layer_norm(a[0], {6}) + a[1], a[2]);
        if (is_dtensor(h)) h = redistribute(h, device_mesh(h), {Shard(1)});
        return V{at::linear(h.transpose(1, 0), a[3])};
      };
      // The smallest form: redistribute(S(2) -> S(1)), transpose(1, 0), linear.
      auto small = [](const V& a) {
        auto h = a[0];
        if (is_dtensor(h)) h = redistribute(h, device_mesh(h), {Shard(1)});
        return V{at::linear(h.transpose(1, 0), a[1])};
      };
      at::manual_seed(21);
      SweepCounter counter;
      counter.add(check_op(mesh, "layer_norm chain", chain,
                           {at::randn({9, 3, 6}, at::kDouble), at::randn({6}, at::kDouble),
                            at::randn({7, 6}, at::kDouble), at::randn({5, 7}, at::kDouble)},
                           {{Shard(2)}, {Replicate()}, {Shard(0)}, {Replicate()}}));
      for (const Placements& p : placements_1d(3)) {
        counter.add(check_op(mesh, "redistribute, transpose, linear from " + to_string(p), small,
                             {at::randn({9, 3, 7}, at::kDouble), at::randn({5, 7}, at::kDouble)},
                             {p, {Replicate()}}));
      }
      // Forward too: redistributing a transposed DTensor gathered into a contiguous shard while
      // the global strides stayed transposed; transposed back, the global tensor is contiguous
      // and view() is valid, but not on the shard.
      auto viewed = [](const V& a) {
        auto h = a[0].transpose(0, 2);
        if (is_dtensor(h)) h = redistribute(h, device_mesh(h), {Shard(1)});
        return V{h.transpose(0, 2).view({27, 7}) * 2};
      };
      for (const Placements& p : placements_1d(3)) {
        counter.add(check_op(mesh, "transpose, redistribute, transpose, view from " + to_string(p),
                             viewed, {at::randn({9, 3, 7}, at::kDouble)}, {p}));
      }
      EXPECT_EQ(counter.failures, 0);
      counter.expect_cases(9, rank,
                           "redistribute + transpose + linear, world " + std::to_string(world));
    });
  }
}

// The issue-36 chain on 2 ranks: the gradient of sum() is a broadcast (every stride 0) that the
// redistribute's backward cut into shards; the shards were copied dense while the global
// strides stayed 0, so after the permute's backward the shard was a permuted dense tensor that
// linear's backward could not view as [72, 4] although the global strides allowed it: "view
// size is not compatible with input tensor's size and stride (while running
// aten::_reshape_alias on DTensor inputs (S(3))[2, 4, 9, 4])".
TEST(StrideSweep, SumOfANarrowedLinearPermutedAndRedistributedMatchesOneDevice) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::manual_seed(36);
    const auto x0 = at::randn({9, 4, 9, 2}, at::kDouble);
    const auto w1 = at::randn({4, 2}, at::kDouble);
    const auto bias2 = at::randn({4}, at::kDouble);
    auto chain = [](at::Tensor x, const at::Tensor& w, const at::Tensor& b) {
      x = at::linear(x.narrow(-4, 5, 2).narrow(1, 0, 4), w, b).permute({0, 3, 2, 1});
      return shard_as(x, 1);
    };
    auto local = x0.narrow(3, rank, 1).clone().requires_grad_(true);
    auto w = distribute_tensor(w1, mesh, {Shard(0)}).requires_grad_(true);
    auto b = distribute_tensor(bias2, mesh, {Shard(0)}).requires_grad_(true);
    auto out = chain(from_local(local, mesh, {Shard(3)}), w, b);
    try {
      out.sum().backward();
    } catch (const c10::Error& e) {
      FAIL() << "backward threw: " << e.what_without_backtrace();
    }
    auto px = x0.clone().requires_grad_(true);
    auto pw = w1.clone().requires_grad_(true);
    auto pb = bias2.clone().requires_grad_(true);
    auto ref = chain(px, pw, pb);
    ref.sum().backward();
    EXPECT_TENSOR_CLOSE(full_tensor(out), ref, 1e-12, 1e-12);
    EXPECT_TENSOR_CLOSE(local.grad(), px.grad().narrow(3, rank, 1), 1e-12, 1e-12);
    EXPECT_TENSOR_CLOSE(full_tensor(w.grad()), pw.grad(), 1e-12, 1e-12);
    EXPECT_TENSOR_CLOSE(full_tensor(b.grad()), pb.grad(), 1e-12, 1e-12);
    EXPECT_TRUE(same_layout(w.grad(), pw.grad()));
  });
}

// The second chain, on 4 ranks: cat of a Shard(0) tensor, redistribute(Shard(0)),
// permute, sum; every cat dim and operand count, from_local and distribute_tensor leaves.
TEST(StrideSweep, SumOfACatRedistributedAndPermutedMatchesOneDevice) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    at::manual_seed(36);
    const auto x0 = at::randn({6, 5, 3}, at::kDouble);
    SweepCounter counter;
    for (int64_t dim = 0; dim < 3; ++dim) {
      for (int n : {1, 2}) {
        auto chain = [dim, n](const std::vector<at::Tensor>& a) {
          auto h = at::cat(std::vector<at::Tensor>(n, a[0]), dim);
          return std::vector<at::Tensor>{shard_as(h, 0).permute({2, 0, 1})};
        };
        counter.add(check_op(mesh,
                             "cat(dim " + std::to_string(dim) + ", " + std::to_string(n) +
                                 " operands), redistribute, permute, sum",
                             chain, {x0}, {{Shard(0)}}, {.sum_loss = true}));
      }
    }
    EXPECT_EQ(counter.failures, 0);
    counter.expect_cases(6, rank, "cat, redistribute, permute, sum on 4 ranks");
  });
}

namespace {

// A seeded random chain of shape ops, linears, pointwise ops, reductions and redistributes on a
// 4-D x, with a weight w [4, 6] (linear takes its first in-features columns) and a bias b [4].
// Each step is drawn from the shape the chain has reached, so the DTensor and the plain run
// apply the same ops.
struct Chain {
  std::string label;
  std::vector<std::function<at::Tensor(const at::Tensor& h, const std::vector<at::Tensor>& a)>>
      steps;
};

Chain random_chain(std::mt19937& rng, std::vector<int64_t> shape) {
  const auto pick = [&rng](int64_t n) { return static_cast<int64_t>(rng() % n); };
  Chain c;
  const int64_t length = 3 + pick(4);
  for (int64_t i = 0; i < length; ++i) {
    const int64_t n = static_cast<int64_t>(shape.size());
    switch (pick(8)) {
      case 0: {  // narrow
        const int64_t d = pick(n), len = 1 + pick(shape[d]), start = pick(shape[d] - len + 1);
        c.label += " narrow(" + std::to_string(d) + "," + std::to_string(start) + "," +
                   std::to_string(len) + ")";
        c.steps.push_back([=](const at::Tensor& h, auto&) { return h.narrow(d, start, len); });
        shape[d] = len;
        break;
      }
      case 1:
      case 2: {  // permute
        std::vector<int64_t> perm(n);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        c.label += " permute" + c10::str(perm);
        c.steps.push_back([=](const at::Tensor& h, auto&) { return h.permute(perm); });
        std::vector<int64_t> next(n);
        for (int64_t k = 0; k < n; ++k) next[k] = shape[perm[k]];
        shape = next;
        break;
      }
      case 3: {  // linear (its backward reshapes the gradient to 2-D)
        const int64_t in = shape.back();
        if (in > 6) break;
        const bool bias = pick(2) == 0;
        c.label += bias ? " linear+bias" : " linear";
        c.steps.push_back([=](const at::Tensor& h, const std::vector<at::Tensor>& a) {
          const auto w = a[1].narrow(1, 0, in);
          return bias ? at::linear(h, w, a[2]) : at::linear(h, w);
        });
        shape.back() = 4;
        break;
      }
      case 4: {  // flatten two neighbouring dims (a view where the strides allow it)
        if (n < 3) break;
        const int64_t d = pick(n - 1);
        c.label += " flatten(" + std::to_string(d) + ")";
        c.steps.push_back([=](const at::Tensor& h, auto&) { return h.flatten(d, d + 1); });
        shape[d] *= shape[d + 1];
        shape.erase(shape.begin() + d + 1);
        break;
      }
      case 5: {  // reduce one dim
        if (n < 3) break;
        const int64_t d = pick(n);
        c.label += " sum(" + std::to_string(d) + ")";
        c.steps.push_back([=](const at::Tensor& h, auto&) { return h.sum(d); });
        shape.erase(shape.begin() + d);
        break;
      }
      case 6:
        c.label += " tanh";
        c.steps.push_back([](const at::Tensor& h, auto&) { return at::tanh(h); });
        break;
      default: {  // redistribute on the first mesh dim
        const int64_t d = pick(n + 1) - 1;
        c.label += d < 0 ? " redistribute(R)" : " redistribute(S(" + std::to_string(d) + "))";
        c.steps.push_back([=](const at::Tensor& h, auto&) {
          if (d >= 0 || !is_dtensor(h)) return shard_as(h, d);
          Placements p(static_cast<size_t>(device_mesh(h).ndim()), Replicate());
          return redistribute(h, device_mesh(h), p);
        });
        break;
      }
    }
  }
  return c;
}

// `count` random chains on `mesh`, x's layout drawn from `x_layouts`, each with a weighted and
// a plain-sum loss.
void random_chains(const DeviceMesh& mesh, int rank, uint32_t seed, int count,
                   const std::vector<Placements>& x_layouts,
                   const std::vector<Placements>& w_layouts) {
  std::mt19937 rng(seed);
  at::manual_seed(seed);
  SweepCounter counter;
  for (int i = 0; i < count; ++i) {
    std::vector<int64_t> shape;
    for (int d = 0; d < 4; ++d) shape.push_back(2 + static_cast<int64_t>(rng() % 4));
    const Chain chain = random_chain(rng, shape);
    const Placements& px = x_layouts[rng() % x_layouts.size()];
    const Placements& pw = w_layouts[rng() % w_layouts.size()];
    const Placements& pb = w_layouts[rng() % 2];  // R or S(0): b has one dim
    auto fn = [&chain](const std::vector<at::Tensor>& a) {
      at::Tensor h = a[0];
      for (const auto& step : chain.steps) h = step(h, a);
      return std::vector<at::Tensor>{h};
    };
    const std::vector<at::Tensor> inputs{
        at::randn(shape, at::kDouble), at::randn({4, 6}, at::kDouble), at::randn({4}, at::kDouble)};
    const std::string label = "x" + c10::str(shape) + " " + to_string(px) + ":" + chain.label;
    counter.add(check_op(mesh, label, fn, inputs, {px, pw, pb}));
    counter.add(check_op(mesh, label + ", sum loss", fn, inputs, {px, pw, pb}, {.sum_loss = true}));
  }
  EXPECT_EQ(counter.failures, 0);
  counter.expect_cases(
      2 * count, rank,
      "random view/linear/redistribute chains on a " + c10::str(mesh.shape()) + " mesh");
}

}  // namespace

TEST(StrideSweep, RandomChainsOfViewsLinearsAndRedistributesMatchOneDevice) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      random_chains(mesh, rank, 100 + world, 40, placements_1d(4, /*with_partial=*/true),
                    {{Replicate()}, {Shard(0)}, {Shard(1)}});
    });
  }
}

TEST(StrideSweep, RandomChainsOnATwoByTwoMeshMatchOneDevice) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    random_chains(mesh, rank, 7, 20,
                  {{Shard(0), Shard(3)},
                   {Shard(3), Replicate()},
                   {Replicate(), Shard(1)},
                   {Partial(), Shard(2)},
                   {Shard(1), Shard(1)}},
                  {{Replicate(), Replicate()}, {Shard(0), Replicate()}, {Replicate(), Shard(1)}});
  });
}
