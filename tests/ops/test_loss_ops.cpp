// Cross entropy / nll_loss without loss_parallel: sweeps over input shapes (N,C), (N,C,d),
// (N,C,h,w), (C) x reductions x class weights x ignore_index x placements x world sizes against
// one device, forward and backward; plus the placements and collectives of PyTorch's
// test_nll_loss_and_cross_entropy.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>

#include "dtensor/dtensor.h"
#include "support/comm_counts.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;
namespace F = torch::nn::functional;

namespace {

struct LossCase {
  std::vector<int64_t> input;  // target: the input without dim 1 (dim 0 for 1-D inputs)
};

const std::vector<LossCase>& loss_cases() {
  static const std::vector<LossCase> c{{{8, 5}}, {{7, 5}}, {{6, 5, 3}}, {{4, 5, 3, 2}}, {{5}}};
  return c;
}

std::vector<int64_t> target_shape(const std::vector<int64_t>& input) {
  if (input.size() == 1) return {};
  std::vector<int64_t> t = input;
  t.erase(t.begin() + 1);
  return t;
}

enum class Reduce { None, Mean, Sum };
const char* name(Reduce r) {
  return r == Reduce::None ? "none" : r == Reduce::Mean ? "mean" : "sum";
}

F::CrossEntropyFuncOptions ce_options(Reduce r, bool weighted, const at::Tensor& weight,
                                      int64_t ignore) {
  F::CrossEntropyFuncOptions o;
  if (r == Reduce::None) o.reduction(torch::kNone);
  if (r == Reduce::Mean) o.reduction(torch::kMean);
  if (r == Reduce::Sum) o.reduction(torch::kSum);
  if (weighted) o.weight(weight);
  o.ignore_index(ignore);
  return o;
}

int64_t reduction_enum(Reduce r) {
  return r == Reduce::None   ? at::Reduction::None
         : r == Reduce::Mean ? at::Reduction::Mean
                             : at::Reduction::Sum;
}

F::NLLLossFuncOptions nll_options(Reduce r, bool weighted, const at::Tensor& weight,
                                  int64_t ignore) {
  F::NLLLossFuncOptions o;
  if (r == Reduce::None) o.reduction(torch::kNone);
  if (r == Reduce::Mean) o.reduction(torch::kMean);
  if (r == Reduce::Sum) o.reduction(torch::kSum);
  if (weighted) o.weight(weight);
  o.ignore_index(ignore);
  return o;
}

}  // namespace

TEST(LossSweep, CrossEntropyAndNllLossMatchOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      for (const auto& c : loss_cases()) {
        auto x = at::randn(c.input, at::kDouble);
        const int64_t classes = c.input.size() == 1 ? c.input[0] : c.input[1];
        auto weight = at::rand({classes}, at::kDouble) + 0.1;
        // Targets with class 2 (ignored below) and -100 (the default ignore_index) among them.
        auto target = at::randint(classes, target_shape(c.input), at::kLong);
        auto padded = target.clone();
        if (padded.dim() > 0) padded.flatten()[0] = -100;
        std::vector<Placements> target_placements{{Replicate()}};
        if (target.dim() > 0) target_placements.push_back({Shard(0)});
        for (Reduce r : {Reduce::None, Reduce::Mean, Reduce::Sum}) {
          for (int variant = 0; variant < 4; ++variant) {
            // plain; class weights; ignore_index 2; weights and -100 padding
            const bool weighted = variant == 1 || variant == 3;
            const int64_t ignore = variant == 2 ? 2 : -100;
            const at::Tensor& t = variant == 3 ? padded : target;
            const bool nll = variant % 2 == 1;  // half the variants call nll_loss on log-probs
            OpFn fn = [r, weighted, ignore, nll](const std::vector<at::Tensor>& a) {
              if (nll) {
                // at::nll_loss_nd: F::nll_loss refuses 1-D inputs.
                return std::vector<at::Tensor>{
                    at::nll_loss_nd(at::log_softmax(a[0], a[0].dim() > 1 ? 1 : 0), a[1],
                                    weighted ? a[2] : at::Tensor(), reduction_enum(r), ignore)};
              }
              return std::vector<at::Tensor>{
                  F::cross_entropy(a[0], a[1], ce_options(r, weighted, a[2], ignore))};
            };
            for (const auto& px : placements_1d(x.dim(), true)) {
              for (const auto& pt : target_placements) {
                const auto label =
                    std::string(nll ? "nll_loss" : "cross_entropy") + " " + c10::str(x.sizes()) +
                    " " + name(r) + (weighted ? " weighted" : "") + " ignore " +
                    std::to_string(ignore) + " x" + to_string(px) + " target" + to_string(pt);
                n.add(check_op(mesh, label, fn, {x, t, weight}, {px, pt, {Replicate()}},
                               {.requires_grad = {true, false, false}}));
              }
            }
          }
        }
      }
      // 3 reductions x 4 variants = 12 per (input layout, target layout): inputs [8, 5], [7, 5],
      // [6, 5, 3], [4, 5, 3, 2] have ndim + 2 layouts and 2 target layouts, [5] has 3 and 1.
      n.expect_cases(12 * (4 * 2 + 4 * 2 + 5 * 2 + 6 * 2 + 3 * 1), rank,
                     c10::str("cross_entropy / nll_loss, world ", world));
    });
  }
}

TEST(LossSweep, TwoDimensionalMeshMatchesOneDevice) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    SweepCounter n;
    auto x = at::randn({6, 5, 4}, at::kDouble);
    auto weight = at::rand({5}, at::kDouble) + 0.1;
    auto target = at::randint(5, {6, 4}, at::kLong);
    const std::vector<Placement> choices{Replicate(), Shard(0), Shard(1), Shard(2)};
    const std::vector<Placements> target_placements{{Replicate(), Replicate()},
                                                    {Shard(0), Replicate()},
                                                    {Shard(0), Shard(1)},
                                                    {Replicate(), Shard(0)}};
    for (Reduce r : {Reduce::None, Reduce::Mean, Reduce::Sum}) {
      OpFn fn = [r](const std::vector<at::Tensor>& a) {
        return std::vector<at::Tensor>{F::cross_entropy(a[0], a[1], ce_options(r, true, a[2], 2))};
      };
      for (const auto& p0 : choices) {
        for (const auto& p1 : choices) {
          for (const auto& pt : target_placements) {
            Placements px{p0, p1};
            n.add(check_op(mesh,
                           std::string("cross_entropy ") + name(r) + " x" + to_string(px) +
                               " target" + to_string(pt),
                           fn, {x, target, weight}, {px, pt, {Replicate(), Replicate()}},
                           {.requires_grad = {true, false, false}}));
          }
        }
      }
    }
    // 3 reductions x 4 x 4 input layouts x 4 target layouts.
    n.expect_cases(3 * 4 * 4 * 4, rank, "cross_entropy, 2x2 mesh");
  });
}

// PyTorch's test_nll_loss_and_cross_entropy: a replicated target; a batch (or spatial) shard
// runs with no communication and leaves a Shard ("none") or Partial output; a class shard is
// gathered once and the output is replicated. Gradients keep the input's shard.
TEST(Loss, PlacementsAndCollectivesLikePyTorch) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> setups{
        {{8, 16}, {8}}, {{8, 16, 12}, {8, 12}}};
    for (const auto& [input_size, target_size] : setups) {
      auto x = at::rand(input_size, at::kDouble);
      auto target = at::randint(16, target_size, at::kLong);
      auto dist_target = distribute_tensor(target, mesh, {Replicate()});
      for (int64_t shard = 0; shard < static_cast<int64_t>(input_size.size()); ++shard) {
        for (Reduce r : {Reduce::None, Reduce::Mean, Reduce::Sum}) {
          for (bool ce : {false, true}) {
            SCOPED_TRACE(std::string(ce ? "cross_entropy" : "nll_loss") + " shard " +
                         std::to_string(shard) + " " + name(r) + " " +
                         c10::str(c10::IntArrayRef(input_size)));
            auto loss = [&](const at::Tensor& in, const at::Tensor& t) {
              return ce ? F::cross_entropy(in, t, ce_options(r, false, {}, -100))
                        : F::nll_loss(in, t, nll_options(r, false, {}, -100));
            };
            try {
              auto xr = x.clone().requires_grad_(true);
              auto y = loss(xr, target);
              (r == Reduce::None ? y.sum() : y).backward();

              auto dx = distribute_tensor(x, mesh, {Shard(shard)}).requires_grad_(true);
              CommDebugMode comm;
              auto dy = loss(dx, dist_target);
              if (shard == 1) {
                EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::all_gather_into_tensor, 1}}));
                EXPECT_EQ(placements(dy)[0], Replicate());
              } else {
                EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
                if (r == Reduce::None) {
                  EXPECT_EQ(placements(dy)[0], Shard(shard < 1 ? shard : shard - 1));
                } else {
                  EXPECT_TRUE(placements(dy)[0].is_partial());
                }
              }
              EXPECT_TENSOR_CLOSE(full_tensor(dy.detach()), y.detach(), 1e-10, 1e-10);
              comm.exit();
              // "none": an explicit cotangent, not sum(): see
              // NoneLossSumBackwardThroughSpatialReshape
              if (r == Reduce::None) {
                dy.backward(at::ones_like(dy));
              } else {
                dy.backward();
              }
              EXPECT_EQ(placements(dx.grad())[0], shard == 1 ? Replicate() : Shard(shard));
              EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-10, 1e-10);
            } catch (const c10::Error& e) {
              ADD_FAILURE() << e.what_without_backtrace();
            }
          }
        }
      }
    }
  });
}

// "mean" over a batch-sharded input whose shards have different total weights (class
// weights, ignored targets): the result is the batch mean, not the mean of shard means. A
// sharded target costs one scalar all_reduce; a replicated one costs nothing.
TEST(Loss, WeightedMeanOverUnequalShardsIsTheBatchMean) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = at::randn({6, 4}, at::kDouble);
    auto target = at::tensor({0, 2, 2, 1, 3, 3}, at::kLong);
    auto weight = at::tensor({1.0, 2.0, 5.0, 0.5}, at::kDouble);
    auto options = ce_options(Reduce::Mean, true, weight, 3);
    auto xr = x.clone().requires_grad_(true);
    auto ref = F::cross_entropy(xr, target, options);
    ref.backward();
    auto dweight = distribute_tensor(weight, mesh, {Replicate()});
    for (const Placements& pt : {Placements{Replicate()}, Placements{Shard(0)}}) {
      SCOPED_TRACE("target " + to_string(pt));
      auto dx = distribute_tensor(x, mesh, {Shard(0)}).requires_grad_(true);
      auto dt = distribute_tensor(target, mesh, pt);
      CommDebugMode comm;
      auto loss = F::cross_entropy(dx, dt, ce_options(Reduce::Mean, true, dweight, 3));
      EXPECT_EQ(comm.get_comm_counts(),
                pt[0].is_shard() ? counts({{CommType::all_reduce, 1}}) : CommCounts{});
      EXPECT_TRUE(placements(loss)[0].is_partial());
      comm.enter();
      loss.backward();
      EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
      comm.exit();
      EXPECT_TENSOR_CLOSE(full_tensor(loss.detach()), ref.detach(), 1e-12, 1e-12);
      EXPECT_EQ(placements(dx.grad())[0], Shard(0));
      EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-12, 1e-12);
    }
  });
}

// Known failure outside the loss rules: sum()'s backward hands an expanded (stride-0) gradient
// to the backward of nll_loss_nd's reshape (N,C,d) -> (N,1,d), which reaches
// aten::_reshape_alias; its view rule rewrites the strides to contiguous ones for the local
// shape, giving a local tensor that overruns its one-element storage ("setStorage ... out of
// bounds"). Enable once _reshape_alias keeps the local tensor's own strides.
TEST(Loss, NoneLossSumBackwardThroughSpatialReshape) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = at::rand({8, 16, 12}, at::kDouble);
    auto target = at::randint(16, {8, 12}, at::kLong);
    auto dx = distribute_tensor(x, mesh, {Shard(0)}).requires_grad_(true);
    auto y = at::nll_loss_nd(dx, distribute_tensor(target, mesh, {Replicate()}), {},
                             at::Reduction::None, -100);
    y.sum().backward();
    auto xr = x.clone().requires_grad_(true);
    at::nll_loss_nd(xr, target, {}, at::Reduction::None, -100).sum().backward();
    EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-12, 1e-12);
  });
}
