// Expert parallelism against one device: float64 blocks (tests/support/moe_blocks.h) whose
// experts are sharded over ep 2 (and over ep 2 x tp 2 on 4 ranks), each ep rank routing its own
// tokens, give for three AdamW steps the one-device reference's loss (with the auxiliary loss),
// input gradient, every parameter's gradient and every parameter within 1e-9, in both dispatch
// modes; in capacity mode with a small factor the choices dropped are those the reference drops
// (counted here in token order, independently of the library), with the collectives per block
// asserted by formula and no host read in a capacity-mode step.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <string>
#include <vector>

#include "dtensor/comm/capture_rehearsal.h"
#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/core/api.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/expert_parallel.h"
#include "dtensor/models/moe.h"
#include "dtensor/tp/parallelize_module.h"
#include "dtensor/tp/partial_grads.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/model_compare.h"
#include "support/moe_blocks.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

constexpr int64_t kTokens = 6;  // per ep rank: one sequence of 6 tokens
constexpr double kAuxCoef = 0.1;

// One device's loss for one ep rank's tokens x (1, kTokens, 32): sum(y * upstream) plus the
// auxiliary loss. With capacity > 0 each expert keeps the first `capacity` choices in token order
// (a token's better choice first) and the others count with weight zero; `dropped` gets their
// number.
at::Tensor reference_loss(MoE& ref, const at::Tensor& x, const at::Tensor& upstream,
                          int64_t capacity, int64_t& dropped) {
  const MoeOptions& o = ref->options;
  if (capacity == 0) {
    dropped = 0;
    const at::Tensor y = ref->forward(x);
    return (y * upstream).sum() +
           kAuxCoef * load_balancing_loss({ref->last_router_logits()}, o.num_experts, o.top_k);
  }
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  Routing routing = route(flat, ref->router->weight, ref->router->bias, o);
  const at::Tensor experts = routing.experts.reshape(-1).contiguous();
  std::vector<int64_t> taken(static_cast<size_t>(o.num_experts), 0);
  std::vector<double> keep;
  dropped = 0;
  for (int64_t i = 0; i < experts.numel(); ++i) {
    const bool kept = taken[static_cast<size_t>(experts[i].item<int64_t>())]++ < capacity;
    keep.push_back(kept ? 1.0 : 0.0);
    dropped += kept ? 0 : 1;
  }
  routing.weights = routing.weights * at::tensor(keep, at::kDouble).view(routing.weights.sizes());
  const at::Tensor y = experts_forward(flat, routing, ref->experts->weights(), o).view(x.sizes());
  return (y * upstream).sum() +
         kAuxCoef * load_balancing_loss({routing.logits}, o.num_experts, o.top_k);
}

// The collectives of one block's step, by formula: forward ep's all-to-alls (the counts exchange,
// dispatch and combine when dropless; dispatch and combine with capacity) and tp's output
// all-reduce; backward the dispatch's and combine's all-to-alls and tp's input-gradient
// all-reduce; then reduce_partial_grads: the router's gradient (Partial over every mesh dim, one
// all-reduce each) and, under tp, b2's (Partial over tp).
struct StepCounts {
  CommCounts forward, backward, partial_grads;
};
StepCounts expected_counts(MoeDispatch dispatch, int64_t tp, bool b2) {
  StepCounts c;
  c.forward[CommType::all_to_all_single] = dispatch == MoeDispatch::kDropless ? 3 : 2;
  c.backward[CommType::all_to_all_single] = 2;
  if (tp > 1) {
    c.forward[CommType::all_reduce] = 1;
    c.backward[CommType::all_reduce] = 1;
  }
  c.partial_grads[CommType::all_reduce] = (tp > 1 ? 2 : 1) + (tp > 1 && b2 ? 1 : 0);
  return c;
}

// Three AdamW steps of every block variant, parallelized by `parallelize` on `mesh` (with an
// "ep" dim, and a "tp" dim or none), against one device running each ep rank's tokens.
void expect_three_steps_like_one_device(const DeviceMesh& mesh,
                                        const std::function<void(MoE&)>& parallelize,
                                        const ExpertParallelOptions& ep_options,
                                        bool expect_drops) {
  const int64_t ep = mesh.ndim() == 1 ? mesh.size() : mesh.size(mesh.dim_index("ep"));
  const int64_t tp = mesh.size() / ep;
  const int64_t mine = mesh.ndim() == 1 ? mesh.get_local_rank() : mesh.get_local_rank("ep");
  for (const MoeOptions& o : moe_variants()) {
    SCOPED_TRACE(
        c10::str("experts=", o.num_experts, " dispatch=", moe_dispatch_name(ep_options.dispatch)));
    MoE ref = seeded_block(o, 5), moe = seeded_block(o, 5);
    parallelize(moe);
    ASSERT_TRUE(is_dtensor(moe->experts->w1) && is_dtensor(moe->router->weight));
    EXPECT_EQ(local_of(moe->experts->w1).size(0), o.num_experts / ep) << "experts per rank";
    torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt(moe->parameters(), torch::optim::AdamWOptions(1e-2));
    at::manual_seed(9);
    const at::Tensor x0 = at::randn({ep, kTokens, 32}, at::kDouble);
    const at::Tensor upstream = at::randn({ep, kTokens, 32}, at::kDouble);
    const int64_t capacity =
        ep_options.dispatch == MoeDispatch::kCapacity
            ? expert_capacity(kTokens, o.top_k, o.num_experts, ep_options.capacity_factor)
            : 0;
    const StepCounts counts = expected_counts(ep_options.dispatch, tp, o.expert_bias);
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE(c10::str("step ", step));
      ref_opt.zero_grad();
      opt.zero_grad();
      std::vector<at::Tensor> ref_inputs, ref_losses;
      std::vector<int64_t> ref_dropped(static_cast<size_t>(ep));
      at::Tensor total = at::zeros({}, at::kDouble);
      for (int64_t r = 0; r < ep; ++r) {
        ref_inputs.push_back(x0.narrow(0, r, 1).clone().requires_grad_(true));
        ref_losses.push_back(reference_loss(ref, ref_inputs.back(), upstream.narrow(0, r, 1),
                                            capacity, ref_dropped[static_cast<size_t>(r)]));
        total = total + ref_losses.back();
      }
      total.backward();
      int64_t all_dropped = 0;
      for (int64_t d : ref_dropped) all_dropped += d;
      EXPECT_EQ(all_dropped > 0, expect_drops) << all_dropped << " choices dropped";

      const at::Tensor input = x0.narrow(0, mine, 1).clone().requires_grad_(true);
      CommDebugMode comm;
      const at::Tensor y = moe->forward(input);
      const at::Tensor loss =
          (y * upstream.narrow(0, mine, 1)).sum() +
          kAuxCoef * load_balancing_loss({moe->last_router_logits()}, o.num_experts, o.top_k);
      EXPECT_EQ(format_comm_counts(comm.get_comm_counts()), format_comm_counts(counts.forward))
          << "forward";
      comm.enter();
      loss.backward();
      EXPECT_EQ(format_comm_counts(comm.get_comm_counts()), format_comm_counts(counts.backward))
          << "backward";
      comm.enter();
      tp::reduce_partial_grads(*moe);
      EXPECT_EQ(format_comm_counts(comm.get_comm_counts()),
                format_comm_counts(counts.partial_grads))
          << "reduce_partial_grads";
      comm.exit();
      EXPECT_EQ(moe->expert_dispatch->last_dropped.item<int64_t>(),
                ref_dropped[static_cast<size_t>(mine)]);
      EXPECT_NEAR(loss.item<double>(), ref_losses[static_cast<size_t>(mine)].item<double>(), 1e-9);
      EXPECT_TRUE(close_to_scale(input.grad(), ref_inputs[static_cast<size_t>(mine)].grad(), 1e-9))
          << "input grad";
      expect_like_one_device(moe, ref, /*after_step=*/false);
      ref_opt.step();
      opt.step();
      expect_like_one_device(moe, ref, /*after_step=*/true);
    }
  }
}

// Dropless; capacity with room for every choice (factor 4: a rank's 12 choices fit any
// expert); capacity with a factor that drops.
struct Mode {
  ExpertParallelOptions options;
  bool drops;
};
std::vector<Mode> modes() {
  return {{{.dispatch = MoeDispatch::kDropless}, false},
          {{.dispatch = MoeDispatch::kCapacity, .capacity_factor = 4.0}, false},
          {{.dispatch = MoeDispatch::kCapacity, .capacity_factor = 0.5}, true}};
}

TEST(ExpertParallel, ThreeAdamWStepsAtEp2EqualOneDeviceInEveryDispatchMode) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"ep"});
    for (const Mode& m : modes()) {
      expect_three_steps_like_one_device(
          mesh,
          [&](MoE& moe) {
            tp::parallelize_module(*moe, mesh, ExpertParallel(m.options), std::nullopt);
          },
          m.options, m.drops);
    }
  });
}

TEST(ExpertParallel, ThreeAdamWStepsAtEp2xTp2EqualOneDeviceInEveryDispatchMode) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"ep", "tp"});
    for (const Mode& m : modes()) {
      expect_three_steps_like_one_device(
          mesh, [&](MoE& moe) { apply_expert_parallel(*moe, mesh, m.options); }, m.options,
          m.drops);
    }
  });
}

// EP folded over the tensor-parallel ranks of one replica: the ep ranks hold the same tokens
// (each routes its 1/ep, the output gathered) or each its sequence shard, and the auxiliary loss
// is the replica's (the router logits gathered, its gradient counted once). The gradients summed
// over the ranks' losses equal one device's for the whole batch, and so do the outputs and the
// auxiliary loss.
TEST(ExpertParallel, TokensSharedOverTheEpRanksGiveOneDevicesGradients) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"ep"});
    const int64_t rank = mesh.get_local_rank();
    for (ExpertTokens tokens : {ExpertTokens::kReplicated, ExpertTokens::kSequenceShard}) {
      for (const MoeOptions& o : moe_variants()) {
        SCOPED_TRACE(c10::str("experts=", o.num_experts,
                              " sequence shards=", tokens == ExpertTokens::kSequenceShard));
        MoE ref = seeded_block(o, 5), moe = seeded_block(o, 5);
        tp::parallelize_module(*moe, mesh, ExpertParallel({.tokens = tokens}), std::nullopt);
        at::manual_seed(9);
        const at::Tensor x0 = at::randn({2, kTokens, 32}, at::kDouble);
        const at::Tensor upstream = at::randn({2, kTokens, 32}, at::kDouble);
        const at::Tensor ref_input = x0.clone().requires_grad_(true);
        const at::Tensor ref_y = ref->forward(ref_input);
        const at::Tensor ref_aux =
            load_balancing_loss({ref->last_router_logits()}, o.num_experts, o.top_k);
        ((ref_y * upstream).sum() + kAuxCoef * ref_aux).backward();

        const bool shard = tokens == ExpertTokens::kSequenceShard;
        const int64_t half = kTokens / 2;
        auto mine = [&](const at::Tensor& t) { return shard ? t.narrow(1, rank * half, half) : t; };
        const at::Tensor input = mine(x0).clone().requires_grad_(true);
        const at::Tensor y = moe->forward(input);
        const at::Tensor aux =
            load_balancing_loss({moe->last_router_logits()}, o.num_experts, o.top_k);
        // The replica's loss: under sequence shards each rank holds its part of the product.
        ((y * mine(upstream)).sum() + kAuxCoef * aux).backward();
        tp::reduce_partial_grads(*moe);
        EXPECT_TRUE(close_to_scale(y, mine(ref_y).detach(), 1e-9)) << "output";
        EXPECT_NEAR(aux.item<double>(), ref_aux.item<double>(), 1e-9) << "auxiliary loss";
        EXPECT_TRUE(close_to_scale(input.grad(), mine(ref_input.grad()), 1e-9)) << "input grad";
        expect_like_one_device(moe, ref, /*after_step=*/false);
      }
    }
  });
}

// A capacity-mode step reads nothing back to the host (CUDA graph capture's condition); the
// dropless one does (its split sizes), the rehearsal's control.
TEST(ExpertParallel, CapacityStepHasNoHostReadAndDroplessHasOne) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"ep"});
    for (MoeDispatch dispatch : {MoeDispatch::kCapacity, MoeDispatch::kDropless}) {
      const MoeOptions o = moe_variants()[0];
      MoE moe = seeded_block(o, 5);
      apply_expert_parallel(*moe, mesh, {.dispatch = dispatch});
      const at::Tensor x = at::randn({1, kTokens, 32}, at::kDouble).requires_grad_(true);
      comm::CaptureRehearsal rehearsal;
      const at::Tensor y = moe->forward(x);
      (y.sum() + load_balancing_loss({moe->last_router_logits()}, o.num_experts, o.top_k))
          .backward();
      std::string syncs;
      for (const auto& s : rehearsal.syncs()) syncs += s.str() + "; ";
      if (dispatch == MoeDispatch::kCapacity) {
        EXPECT_TRUE(rehearsal.syncs().empty()) << syncs;
      } else {
        EXPECT_FALSE(rehearsal.syncs().empty());
      }
    }
  });
}

TEST(ExpertParallel, RefusesExpertsThatDoNotDivideByEpBeforeChangingTheBlock) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"ep"});
    MoE moe = seeded_block({.num_experts = 3, .top_k = 2}, 1);
    EXPECT_ERROR(apply_expert_parallel(*moe, mesh), c10::Error, "num_experts 3",
                 "not divisible by ep=2");
    EXPECT_ERROR(tp::parallelize_module(*moe, mesh, ExpertParallel()), c10::Error,
                 "num_experts 3 is not divisible by ep=2");
    EXPECT_FALSE(is_dtensor(moe->experts->w1));
    EXPECT_EQ(moe->expert_dispatch, nullptr);
  });
}

}  // namespace
