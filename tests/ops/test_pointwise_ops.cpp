// Sweep: pointwise ops and reductions over shapes x placements x world sizes against one device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

struct NamedOp {
  std::string name;
  int arity;
  OpFn fn;
  double tol = 1e-10;
};

std::vector<NamedOp> binary_ops() {
  auto b = [](std::string n, std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> f) {
    return NamedOp{n, 2, [f](const std::vector<at::Tensor>& x) {
                     return std::vector<at::Tensor>{f(x[0], x[1])};
                   }};
  };
  return {
      b("add", [](auto& a, auto& c) { return a + c; }),
      b("sub", [](auto& a, auto& c) { return a - c; }),
      b("mul", [](auto& a, auto& c) { return a * c; }),
      b("div", [](auto& a, auto& c) { return a / (c.abs() + 1); }),
      b("maximum", [](auto& a, auto& c) { return at::maximum(a, c); }),
      b("where", [](auto& a, auto& c) { return at::where(a > 0, a, c); }),
      b("addcmul", [](auto& a, auto& c) { return at::addcmul(a, a, c, 0.5); }),
      b("lerp", [](auto& a, auto& c) { return at::lerp(a, c, 0.3); }),
  };
}

std::vector<NamedOp> unary_ops() {
  auto u = [](std::string n, std::function<at::Tensor(const at::Tensor&)> f) {
    return NamedOp{
        n, 1, [f](const std::vector<at::Tensor>& x) { return std::vector<at::Tensor>{f(x[0])}; }};
  };
  return {
      u("neg", [](auto& a) { return -a; }),
      u("exp", [](auto& a) { return a.exp(); }),
      u("sigmoid", [](auto& a) { return a.sigmoid(); }),
      u("silu", [](auto& a) { return at::silu(a); }),
      u("gelu", [](auto& a) { return at::gelu(a); }),
      u("tanh", [](auto& a) { return a.tanh(); }),
      u("relu", [](auto& a) { return a.relu(); }),
      u("pow2", [](auto& a) { return a.pow(2); }),
      u("rsqrt_abs", [](auto& a) { return (a.abs() + 1).rsqrt(); }),
      u("mul_scalar", [](auto& a) { return a * 2.5; }),
      u("clamp", [](auto& a) { return a.clamp(-0.5, 0.5); }),
      u("sum", [](auto& a) { return a.sum(); }),
      u("sum_dim0", [](auto& a) { return a.sum(0); }),
      u("sum_last_keep", [](auto& a) { return a.sum(-1, true); }),
      u("mean", [](auto& a) { return a.mean(); }),
      u("mean_dim1", [](auto& a) { return a.mean(1); }),
      u("amax_dim1", [](auto& a) { return a.amax(1); }),
      NamedOp{"to_float_and_back", 1,
              [](const std::vector<at::Tensor>& x) {
                return std::vector<at::Tensor>{x[0].to(at::kFloat).to(at::kDouble)};
              },
              1e-6},  // a Partial is rounded per rank before summing
      u("clone", [](auto& a) { return a.clone(); }),
      u("contiguous_t", [](auto& a) { return a.t().contiguous(); }),
      u("reshape_flat", [](auto& a) { return a.reshape({-1}); }),
      u("unsqueeze_expand",
        [](auto& a) {
          return a.unsqueeze(0).expand({2, -1, -1});
        }),
  };
}

}  // namespace

TEST(PointwiseSweep, BinaryOpsWithBroadcastingMatchOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> shapes = {
          {{4, 6}, {4, 6}}, {{5, 3}, {3}}, {{1, 6}, {7, 6}}, {{2, 1}, {2, 5}}};
      for (const auto& op : binary_ops()) {
        for (const auto& [sa, sb] : shapes) {
          auto a = at::randn(sa, at::kDouble), b = at::randn(sb, at::kDouble);
          for (auto& pl :
               combinations({placements_1d(a.dim(), true), placements_1d(b.dim(), true)})) {
            const std::string label = op.name + " " + to_string(pl[0]) + "x" + to_string(pl[1]);
            n.add(check_op(mesh, label, op.fn, {a, b}, pl));
          }
        }
      }
      // 8 ops x the layout pairs of each shape pair (4 layouts of a 2-D tensor, 3 of a 1-D one).
      n.expect_cases(8 * (4 * 4 + 4 * 3 + 4 * 4 + 4 * 4), rank,
                     c10::str("binary ops, world ", world));
    });
  }
}

TEST(PointwiseSweep, UnaryOpsReductionsAndViewsMatchOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      for (auto shape : std::vector<std::vector<int64_t>>{{4, 6}, {5, 3}, {1, 7}, {3, 1}}) {
        auto a = at::randn(shape, at::kDouble);
        for (const auto& op : unary_ops()) {
          for (const auto& p : placements_1d(a.dim(), true)) {
            n.add(check_op(mesh, op.name + " " + to_string(p) + " " + c10::str(a.sizes()), op.fn,
                           {a}, {p}, {.rtol = op.tol, .atol = op.tol}));
          }
        }
      }
      // 22 ops x 4 shapes x 4 layouts.
      n.expect_cases(22 * 4 * 4, rank, c10::str("unary/reduction/view ops, world ", world));
    });
  }
}

// out= variants (AdamW with amsgrad calls max_out(state, exp_avg_sq, state)): the result goes
// into the out DTensor's local tensor in its own layout; the operands are redistributed to it.
TEST(PointwiseOut, MaximumAndMinimumOutWriteIntoTheOutDTensorInItsLayout) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor a = at::randn({5, 4}, at::kDouble), b = at::randn({5, 4}, at::kDouble);
    const at::Tensor row = at::randn({4}, at::kDouble);
    for (const Placements& out_pl :
         {Placements{Shard(0)}, Placements{Shard(1)}, Placements{Replicate()}}) {
      for (const Placements& b_pl : {Placements{Shard(0)}, Placements{Replicate()}}) {
        SCOPED_TRACE("out " + to_string(out_pl) + ", other " + to_string(b_pl));
        // Aliased like amsgrad: out is also the first operand.
        at::Tensor state = distribute_tensor(a.clone(), mesh, out_pl);
        const at::Tensor local = local_tensor(state);
        at::Tensor& r = at::maximum_out(state, state, distribute_tensor(b, mesh, b_pl));
        EXPECT_TRUE(r.is_same(state));
        EXPECT_TRUE(local_tensor(state).is_same(local));
        EXPECT_EQ(placements(state), out_pl);
        EXPECT_TENSOR_EQ(full_tensor(state), at::maximum(a, b));
        // Separate out, broadcast operand.
        at::Tensor out = distribute_tensor(at::zeros({5, 4}, at::kDouble), mesh, out_pl);
        at::minimum_out(out, distribute_tensor(b, mesh, b_pl),
                        distribute_tensor(row, mesh, {Replicate()}));
        EXPECT_EQ(placements(out), out_pl);
        EXPECT_TENSOR_EQ(full_tensor(out), at::minimum(b, row));
      }
    }
    // A Partial out cannot hold a maximum: a clear error, not a wrong result.
    at::Tensor partial = from_local(at::zeros({5, 4}, at::kDouble), mesh, {Partial()});
    EXPECT_ERROR(at::maximum_out(partial, distribute_tensor(a, mesh, {Replicate()}),
                                 distribute_tensor(b, mesh, {Replicate()})),
                 c10::Error, "aten::maximum.out", "P(sum)");
  });
}

// mean, max and min commute with adding a scalar, a sum does not: P(avg), P(max) and P(min)
// stay Partial through add/sub of a scalar (in place too: CUDA's composite rms_norm adds eps
// in place to a mean over the sharded dim), P(sum) is reduced first.
TEST(PointwiseShift, AScalarAddedToAPartialKeepsItOnlyWhereTheReductionCommutesWithIt) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    // Every rank draws the same two tensors (a common seed); rank r holds base + r * delta.
    const at::Tensor base = at::randn({3, 4}, at::kDouble), delta = at::randn({3, 4}, at::kDouble);
    const at::Tensor local = base + rank * delta;
    const at::Tensor stacked = at::stack({base, base + delta});
    for (const auto& [op, whole] :
         std::vector<std::pair<ReduceOp, at::Tensor>>{{ReduceOp::Avg, stacked.mean(0)},
                                                      {ReduceOp::Max, stacked.amax(0)},
                                                      {ReduceOp::Min, stacked.amin(0)},
                                                      {ReduceOp::Sum, stacked.sum(0)}}) {
      SCOPED_TRACE(reduce_op_name(op));
      const Placements kept =
          op == ReduceOp::Sum ? Placements{Replicate()} : Placements{Partial(op)};
      const at::Tensor p = from_local(local, mesh, {Partial(op)});
      const at::Tensor added = p + 1.5, subtracted = p - 0.25;
      EXPECT_EQ(placements(added), kept);
      EXPECT_EQ(placements(subtracted), kept);
      EXPECT_TENSOR_CLOSE(full_tensor(added), whole + 1.5, 1e-12, 1e-12);
      EXPECT_TENSOR_CLOSE(full_tensor(subtracted), whole - 0.25, 1e-12, 1e-12);
      if (op != ReduceOp::Sum) {
        at::Tensor q = from_local(local.clone(), mesh, {Partial(op)});
        q.add_(1e-6);
        EXPECT_EQ(placements(q), kept);
        EXPECT_TENSOR_CLOSE(full_tensor(q), whole + 1e-6, 1e-12, 1e-12);
      }
    }
  });
}

// Element-wise ops whose backward calls another element-wise op: hardswish_backward,
// hardsigmoid_backward, logit_backward, and mvlgamma's in-place digamma_.
TEST(PointwiseBackward, BackwardOnlyElementWiseOpsMatchOneDevice) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    SweepCounter n;
    const std::vector<NamedOp> ops = {
        {"hardswish", 1,
         [](const auto& x) { return std::vector<at::Tensor>{at::hardswish(x[0] * 4)}; }},
        {"hardsigmoid", 1,
         [](const auto& x) { return std::vector<at::Tensor>{at::hardsigmoid(x[0] * 4)}; }},
        {"logit", 1,
         [](const auto& x) { return std::vector<at::Tensor>{at::logit(x[0].sigmoid(), 0.1)}; }},
        {"mvlgamma", 1,
         [](const auto& x) { return std::vector<at::Tensor>{at::mvlgamma(x[0].abs() + 2, 2)}; }},
    };
    const at::Tensor a = at::randn({5, 4}, at::kDouble);
    for (const auto& op : ops) {
      for (const auto& p : placements_1d(a.dim(), true)) {
        n.add(check_op(mesh, op.name + " " + to_string(p), op.fn, {a}, {p}));
      }
    }
    n.expect_cases(4 * 4, rank, "backward-only element-wise ops");  // ops x R, S(0), S(1), P
  });
}
