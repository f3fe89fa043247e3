// loss_parallel: cross entropy on class-sharded logits inside a LossParallel matches one device,
// costs exactly three all_reduces forward and none backward, and keeps the gradient Shard(1). Label
// smoothing (which PyTorch's loss_parallel gets wrong) matches one device too, for one more
// all_reduce forward. Other shardings raise; outside the guard the ordinary (class-gathering) rules
// still apply.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;
namespace F = torch::nn::functional;

namespace {

enum class Reduce { None, Mean, Sum };
const char* name(Reduce r) {
  return r == Reduce::None ? "none" : r == Reduce::Mean ? "mean" : "sum";
}

F::CrossEntropyFuncOptions options(Reduce r, const at::Tensor& weight, int64_t ignore,
                                   double label_smoothing = 0.0) {
  F::CrossEntropyFuncOptions o;
  o.label_smoothing(label_smoothing);
  o.reduction(r == Reduce::None   ? F::CrossEntropyFuncOptions::reduction_t(torch::kNone)
              : r == Reduce::Mean ? F::CrossEntropyFuncOptions::reduction_t(torch::kMean)
                                  : F::CrossEntropyFuncOptions::reduction_t(torch::kSum));
  if (weight.defined()) o.weight(weight);
  o.ignore_index(ignore);
  return o;
}

// The loss's backward from a fixed cotangent (ones for "none").
void backward(const at::Tensor& y, Reduce r) {
  if (r == Reduce::None) {
    y.backward(at::ones_like(y));
  } else {
    y.backward();
  }
}

}  // namespace

TEST(LossParallel, MatchesOneDeviceWithThreeAllReducesForwardAndNoneBackward) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [](int) {
      const int64_t world = comm::get_world_size();
      auto mesh = init_device_mesh("cpu", {world});
      for (const std::vector<int64_t>& shape : {std::vector<int64_t>{8, 16}, {8, 16, 12}, {16}}) {
        auto x = at::rand(shape, at::kDouble);
        std::vector<int64_t> tshape = shape;
        tshape.erase(tshape.begin() + (shape.size() > 1 ? 1 : 0));  // (16): a 0-d target
        auto target = at::randint(16, tshape, at::kLong);
        if (target.dim() > 0) target.flatten()[0] = 3;  // a target ignored by ignore_index 3
        auto weight = at::rand({16}, at::kDouble);
        for (Reduce r : {Reduce::None, Reduce::Mean, Reduce::Sum}) {
          for (int variant = 0; variant < 3; ++variant) {  // plain; weights; ignore_index 3
            const at::Tensor w = variant == 1 ? weight : at::Tensor();
            const int64_t ignore = variant == 2 ? 3 : -100;
            SCOPED_TRACE(c10::str("world ", world, " ", c10::IntArrayRef(shape), " ", name(r),
                                  " variant ", variant));
            try {
              auto xr = x.clone().requires_grad_(true);
              auto ref = F::cross_entropy(xr, target, options(r, w, ignore));
              backward(ref, r);

              const int64_t cls = shape.size() > 1 ? 1 : 0;
              auto dx = distribute_tensor(x, mesh, {Shard(cls)}).requires_grad_(true);
              auto dtarget = distribute_tensor(target, mesh, {Replicate()});
              auto dw = w.defined() ? distribute_tensor(w, mesh, {Replicate()}) : at::Tensor();
              tp::LossParallel lp;
              CommDebugMode comm;
              auto loss = F::cross_entropy(dx, dtarget, options(r, dw, ignore));
              EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 3}}))
                  << comm.table();
              EXPECT_EQ(placements(loss)[0], Replicate());
              comm.enter();
              backward(loss, r);
              EXPECT_EQ(comm.get_comm_counts(), CommCounts{}) << comm.table();
              comm.exit();
              EXPECT_TENSOR_CLOSE(full_tensor(loss.detach()), ref.detach(), 1e-10, 1e-10);
              EXPECT_EQ(placements(dx.grad())[0], Shard(cls));
              EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-10, 1e-10);
            } catch (const c10::Error& e) {
              ADD_FAILURE() << e.what_without_backtrace();
            }
          }
        }
      }
    });
  }
}

// Smoothing adds eps/C * sum_c -w_c log_softmax_c, whose gradient needs the softmax
// correction that the pass-through log_softmax backward of loss_parallel skips. Each all_reduce
// carries N elements (N = the target's numel); 16 classes on 3 ranks is uneven, 3 classes on 4
// ranks leaves one rank none.
TEST(LossParallel, LabelSmoothingMatchesOneDeviceWithFourAllReducesForwardAndNoneBackward) {
  for (int world : {3, 4}) {
    run_ranks(world, [](int) {
      const int64_t world = comm::get_world_size();
      auto mesh = init_device_mesh("cpu", {world});
      std::vector<std::vector<int64_t>> shapes = {{8, 16}, {4, 16, 5}, {16}};
      if (world == 4) shapes = {{6, 3}, {16}};
      for (const auto& shape : shapes) {
        const int64_t cls = shape.size() > 1 ? 1 : 0;
        const int64_t classes = shape[cls];
        auto x = at::randn(shape, at::kDouble) * 3;
        std::vector<int64_t> tshape = shape;
        tshape.erase(tshape.begin() + cls);
        auto target = at::randint(classes, tshape, at::kLong);
        if (target.dim() > 0) target.flatten()[0] = 1;  // a target ignored by ignore_index 1
        auto weight = at::rand({classes}, at::kDouble) + 0.5;
        for (Reduce r : {Reduce::None, Reduce::Mean, Reduce::Sum}) {
          // plain; weights; ignore_index 1; weights and ignore_index 1 with all mass smoothed
          for (int variant = 0; variant < 4; ++variant) {
            const at::Tensor w = variant % 2 == 1 ? weight : at::Tensor();
            const int64_t ignore = variant >= 2 ? 1 : -100;
            const double eps = variant == 3 ? 1.0 : 0.2;
            SCOPED_TRACE(c10::str("world ", world, " ", c10::IntArrayRef(shape), " ", name(r),
                                  " variant ", variant));
            try {
              auto xr = x.clone().requires_grad_(true);
              auto ref = F::cross_entropy(xr, target, options(r, w, ignore, eps));
              backward(ref, r);

              auto dx = distribute_tensor(x, mesh, {Shard(cls)}).requires_grad_(true);
              auto dtarget = distribute_tensor(target, mesh, {Replicate()});
              auto dw = w.defined() ? distribute_tensor(w, mesh, {Replicate()}) : at::Tensor();
              tp::LossParallel lp;
              CommDebugMode comm;
              auto loss = F::cross_entropy(dx, dtarget, options(r, dw, ignore, eps));
              EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 4}}))
                  << comm.table();
              for (const auto& rec : comm.records()) {
                EXPECT_EQ(rec.bytes, target.numel() * int64_t{sizeof(double)}) << comm.table();
              }
              EXPECT_EQ(placements(loss)[0], Replicate());
              comm.enter();
              backward(loss, r);
              EXPECT_EQ(comm.get_comm_counts(), CommCounts{}) << comm.table();
              comm.exit();
              EXPECT_TENSOR_CLOSE(full_tensor(loss.detach()), ref.detach(), 1e-12, 1e-12);
              EXPECT_EQ(placements(dx.grad())[0], Shard(cls));
              EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-12, 1e-12);
            } catch (const c10::Error& e) {
              ADD_FAILURE() << e.what_without_backtrace();
            }
          }
        }
      }
    });
  }
}

// Plain target and weight tensors join as Replicate with smoothing too; without a guard the
// composite gathers the classes and still matches.
TEST(LossParallel, LabelSmoothingWithPlainTargetAndOutsideTheGuard) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = at::randn({8, 16, 3}, at::kDouble);
    auto target = at::randint(16, {8, 3}, at::kLong);
    auto weight = at::rand({16}, at::kDouble);
    auto xr = x.clone().requires_grad_(true);
    auto ref = F::cross_entropy(xr, target, options(Reduce::Mean, weight, -100, 0.3));
    ref.backward();
    for (bool guard : {true, false}) {
      SCOPED_TRACE(guard ? "inside LossParallel" : "outside");
      auto dx = distribute_tensor(x, mesh, {Shard(1)}).requires_grad_(true);
      std::optional<tp::LossParallel> lp;
      if (guard) lp.emplace();
      at::Tensor loss;
      {
        std::optional<ImplicitReplication> plain;  // outside the guard plain tensors need it
        if (!guard) plain.emplace();
        CommDebugMode comm;
        loss = F::cross_entropy(dx, target, options(Reduce::Mean, weight, -100, 0.3));
        if (guard) {
          EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 4}}));
        }
        comm.enter();
        loss.backward();
        if (guard) {
          EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
        }
      }
      EXPECT_TENSOR_CLOSE(full_tensor(loss.detach()), ref.detach(), 1e-12, 1e-12);
      EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-12, 1e-12);
    }
  });
}

TEST(LossParallel, OtherShardingsRaise) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{8, 16}, {8, 16, 12}}) {
      auto x = at::rand(shape, at::kDouble);
      auto target = at::randint(
          16, shape.size() == 2 ? std::vector<int64_t>{8} : std::vector<int64_t>{8, 12}, at::kLong);
      for (int64_t dim = 0; dim < x.dim(); ++dim) {
        if (dim == 1) continue;
        for (double eps : {0.0, 0.1}) {
          SCOPED_TRACE(c10::str(c10::IntArrayRef(shape), " Shard(", dim, ") smoothing ", eps));
          auto dx = distribute_tensor(x, mesh, {Shard(dim)}).requires_grad_(true);
          auto dtarget = distribute_tensor(target, mesh, {Replicate()});
          tp::LossParallel lp;
          // PyTorch raises a ValueError here too.
          EXPECT_ERROR(
              F::cross_entropy(dx, dtarget, options(Reduce::Mean, at::Tensor(), -100, eps)),
              c10::ValueError, "loss_parallel");
        }
      }
    }
  });
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    auto dx = distribute_tensor(at::rand({8, 16}, at::kDouble), mesh, {Replicate(), Shard(1)});
    tp::LossParallel lp;
    EXPECT_ERROR(F::cross_entropy(dx, distribute_tensor(at::randint(16, {8}, at::kLong), mesh,
                                                        {Replicate(), Replicate()})),
                 c10::ValueError, "one-dimensional DeviceMesh");
  });
}

TEST(LossParallel, OutsideTheGuardTheClassDimIsGathered) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = at::rand({8, 16}, at::kDouble);
    auto target = at::randint(16, {8}, at::kLong);
    auto xr = x.clone().requires_grad_(true);
    auto ref = F::cross_entropy(xr, target);
    ref.backward();
    { tp::LossParallel lp; }  // a guard that has ended leaves nothing behind
    auto dx = distribute_tensor(x, mesh, {Shard(1)}).requires_grad_(true);
    auto dtarget = distribute_tensor(target, mesh, {Replicate()});
    CommDebugMode comm;
    auto loss = F::cross_entropy(dx, dtarget);
    EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_gather_into_tensor, 1}}));
    comm.exit();
    loss.backward();
    EXPECT_TENSOR_CLOSE(full_tensor(loss.detach()), ref.detach(), 1e-10, 1e-10);
    EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-10, 1e-10);
  });
}

TEST(LossParallel, PlainTargetIsTreatedAsReplicate) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto x = at::rand({8, 16}, at::kDouble);
    auto target = at::randint(16, {8}, at::kLong);
    auto xr = x.clone().requires_grad_(true);
    auto ref = F::cross_entropy(xr, target);
    ref.backward();
    auto dx = distribute_tensor(x, mesh, {Shard(1)}).requires_grad_(true);
    tp::LossParallel lp;
    CommDebugMode comm;
    auto loss = F::cross_entropy(dx, target);  // plain target, as PyTorch accepts
    EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 3}}));
    comm.enter();
    loss.backward();
    EXPECT_EQ(comm.get_total_counts(), 0);
    EXPECT_TENSOR_CLOSE(full_tensor(loss.detach()), ref.detach(), 1e-10, 1e-10);
    EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-10, 1e-10);
  });
}

// The one-call form a model uses: (B, S, V) logits sharded on the vocab, backward outside any
// guard, equal to one device's cross entropy and gradient; three all_reduces forward, none back.
TEST(LossParallel, VocabParallelCrossEntropyNeedsNoGuardForBackward) {
  run_ranks(3, [](int) {
    auto mesh = init_device_mesh("cpu", {3});
    at::manual_seed(11);
    const at::Tensor x = at::randn({2, 5, 13}, at::kDouble);
    const at::Tensor target = at::randint(13, {2, 5}, at::kLong);
    auto xr = x.clone().requires_grad_(true);
    auto ref = at::cross_entropy_loss(xr.flatten(0, 1), target.flatten());
    ref.backward();

    auto dx = distribute_tensor(x, mesh, {Shard(2)}).requires_grad_(true);
    for (const at::Tensor& t : {target, distribute_tensor(target, mesh, {Shard(0)})}) {
      dx.mutable_grad() = at::Tensor();
      CommDebugMode comm;
      auto loss = tp::vocab_parallel_cross_entropy(dx, t);
      EXPECT_FALSE(is_dtensor(loss));
      EXPECT_FALSE(tp::loss_parallel_enabled());
      EXPECT_EQ(comm.get_comm_counts()[CommType::all_reduce], 3) << comm.table();
      loss.backward();
      EXPECT_EQ(comm.get_comm_counts()[CommType::all_reduce], 3) << comm.table();
      EXPECT_TENSOR_CLOSE(loss.detach(), ref.detach(), 1e-12, 1e-12);
      EXPECT_EQ(placements(dx.grad())[0], Shard(2));
      EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-12, 1e-12);
    }
    const std::string msg = message_of([&] { tp::vocab_parallel_cross_entropy(x, target); });
    EXPECT_CONTAINS(msg, "vocab_parallel_cross_entropy");
  });
}
