// dtensor::optim::CapturableAdamW against torch::optim::AdamW in float64: plain tensors over
// several steps (weight decay, AMSGrad, two param groups, a parameter without a gradient), a
// step count far from the first (the bias corrections must follow it), and the Llama model at
// TP 2 with sequence parallelism and loss parallel (Partial gradients left for the optimizer)
// and at FSDP 2 x TP 2, each also compared with one device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;
using dtensor::optim::CapturableAdamW;
using dtensor::optim::CapturableAdamWParamState;
using torch::optim::AdamWOptions;

namespace {

// max |a - b|, for messages.
double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Leaves of several shapes (a 0-d one included), float64, from `seed`.
std::vector<at::Tensor> leaves(uint64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (auto shape : std::vector<std::vector<int64_t>>{{5, 3}, {7}, {}, {2, 3, 4}})
    out.push_back(at::randn(shape, at::kDouble).requires_grad_());
  return out;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone().requires_grad_());
  return out;
}

// The same gradient (from `seed`) on both lists; `skip` gets none.
void set_grads(std::vector<at::Tensor>& a, std::vector<at::Tensor>& b, uint64_t seed,
               int skip = -1) {
  at::manual_seed(seed);
  for (size_t i = 0; i < a.size(); ++i) {
    if (static_cast<int>(i) == skip) {
      a[i].mutable_grad() = at::Tensor();
      b[i].mutable_grad() = at::Tensor();
      continue;
    }
    // Scales that differ per element, as real gradients do, so sqrt(v) matters.
    const at::Tensor g = at::randn(a[i].sizes(), at::kDouble) * at::rand(a[i].sizes(), at::kDouble);
    a[i].mutable_grad() = g.clone();
    b[i].mutable_grad() = g.clone();
  }
}

const CapturableAdamWParamState& state_of(const CapturableAdamW& opt, const at::Tensor& p) {
  return static_cast<const CapturableAdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

TEST(CapturableAdamW, EqualsTorchAdamWOnPlainTensorsOverSeveralSteps) {
  for (bool amsgrad : {false, true}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "adam");
    auto ours = leaves(1), theirs = clones(ours);
    // Two groups: the second with its own learning rate and no weight decay.
    const auto defaults =
        AdamWOptions(0.03).betas({0.8, 0.95}).eps(1e-6).weight_decay(0.1).amsgrad(amsgrad);
    auto group = [&](const std::vector<at::Tensor>& ps, size_t from, size_t to, bool second) {
      std::vector<at::Tensor> sub(ps.begin() + from, ps.begin() + to);
      if (!second) return torch::optim::OptimizerParamGroup(sub);
      return torch::optim::OptimizerParamGroup(
          sub, std::make_unique<AdamWOptions>(AdamWOptions(defaults).lr(0.2).weight_decay(0)));
    };
    CapturableAdamW opt({group(ours, 0, 2, false), group(ours, 2, 4, true)}, defaults);
    torch::optim::AdamW ref({group(theirs, 0, 2, false), group(theirs, 2, 4, true)}, defaults);
    for (int step = 0; step < 6; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      // Step 3 leaves parameter 1 without a gradient: its own step count stays behind.
      set_grads(ours, theirs, 100 + step, step == 3 ? 1 : -1);
      opt.step();
      ref.step();
      for (size_t i = 0; i < ours.size(); ++i) {
        EXPECT_LE(max_diff(ours[i], theirs[i]), 1e-12) << "parameter " << i;
      }
    }
    for (size_t i = 0; i < ours.size(); ++i) {
      const auto& s = state_of(opt, ours[i]);
      const auto& r = static_cast<const torch::optim::AdamWParamState&>(
          *ref.state().at(theirs[i].unsafeGetTensorImpl()));
      EXPECT_EQ(s.step().dim(), 0);
      EXPECT_EQ(s.step().scalar_type(), at::kDouble);
      EXPECT_EQ(s.step().device(), ours[i].device());
      EXPECT_EQ(s.step().item<double>(), static_cast<double>(r.step())) << "parameter " << i;
      EXPECT_LE(max_diff(s.exp_avg(), r.exp_avg()), 1e-14);
      EXPECT_LE(max_diff(s.exp_avg_sq(), r.exp_avg_sq()), 1e-14);
      if (amsgrad) {
        EXPECT_LE(max_diff(s.max_exp_avg_sq(), r.max_exp_avg_sq()), 1e-14);
      }
    }
  }
}

// The bias corrections 1 - beta^t are taken from the step count on the device at each step: a
// count moved far from the first step (as a resumed run has) gives torch's update for that
// count, which differs from the first step's corrections by a factor of ~30 here.
TEST(CapturableAdamW, BiasCorrectionsFollowTheStepCount) {
  auto ours = leaves(2), theirs = clones(ours);
  const auto options = AdamWOptions(0.01).weight_decay(0.05);
  CapturableAdamW opt(ours, options);
  torch::optim::AdamW ref(theirs, options);
  set_grads(ours, theirs, 7);
  opt.step();
  ref.step();
  for (size_t i = 0; i < ours.size(); ++i) {
    const_cast<at::Tensor&>(state_of(opt, ours[i]).step()).fill_(40);
    static_cast<torch::optim::AdamWParamState&>(*ref.state().at(theirs[i].unsafeGetTensorImpl()))
        .step(40);
  }
  const auto before = clones(ours);
  set_grads(ours, theirs, 8);
  opt.step();
  ref.step();
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_EQ(state_of(opt, ours[i]).step().item<double>(), 41);
    EXPECT_LE(max_diff(ours[i], theirs[i]), 1e-12) << "parameter " << i;
    EXPECT_GT(max_diff(ours[i], before[i]), 1e-4) << "parameter " << i << " did not move";
  }
}

TEST(CapturableAdamW, RefusesInvalidOptions) {
  auto ps = leaves(3);
  EXPECT_THROW(CapturableAdamW(ps, AdamWOptions(-1)), c10::Error);
  EXPECT_THROW(CapturableAdamW(ps, AdamWOptions(0.1).betas({1.0, 0.9})), c10::Error);
  EXPECT_THROW(CapturableAdamW(ps, AdamWOptions(0.1).weight_decay(-0.1)), c10::Error);
}

// ---- DTensor parameters: the Llama model, float64 ----

DecoderConfig tiny() { return DecoderConfig::preset("tiny"); }

Transformer make_model() {
  Transformer m(tiny());
  m->to(at::kDouble);
  m->init_weights(5);
  return m;
}

// Three steps of one device (torch AdamW), of the parallel model with torch AdamW and with
// CapturableAdamW, on the same batches: the two parallel models agree to 1e-12, and with one
// device to the gradients' rounding. The parallel models' Partial gradients (sequence
// parallelism's norm weights) are left for the optimizers.
void expect_parallel_steps_match(const DeviceMesh& mesh, const ParallelizeOptions& options,
                                 bool expect_partial_grads) {
  const auto adamw = AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
  Transformer one = make_model(), with_torch = make_model(), with_ours = make_model();
  parallelize(*with_torch, mesh, options);
  parallelize(*with_ours, mesh, options);
  torch::optim::AdamW one_opt(one->parameters(), adamw), torch_opt(with_torch->parameters(), adamw);
  CapturableAdamW ours_opt(with_ours->parameters(), adamw);
  const int64_t dp = mesh.ndim() == 2 ? mesh["dp"].size() : 1;
  const int64_t dp_rank = mesh.ndim() == 2 ? mesh["dp"].get_local_rank() : 0;
  const auto config = tiny();
  const auto one_params = params_of(*one), torch_params = params_of(*with_torch),
             our_params = params_of(*with_ours);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::manual_seed(50 + step);
    const int64_t batch = 2 * dp;
    auto tokens = at::randint(config.vocab_size, {batch, 8}, at::kLong);
    auto targets = at::randint(config.vocab_size, {batch, 8}, at::kLong);
    auto mine = [&](const at::Tensor& t) { return t.narrow(0, 2 * dp_rank, 2); };
    for (auto* o : std::vector<torch::optim::Optimizer*>{&one_opt, &torch_opt, &ours_opt})
      o->zero_grad();
    loss_and_backward(one->forward(tokens), targets);
    loss_and_backward(with_torch->forward(mine(tokens)), mine(targets));
    loss_and_backward(with_ours->forward(mine(tokens)), mine(targets));
    int64_t partial = 0;
    for (const auto& [name, p] : our_params) partial += spec_of(p.grad()).has_partial() ? 1 : 0;
    if (expect_partial_grads) {
      EXPECT_GT(partial, 0) << "no Partial gradient reached the optimizer";
    }
    one_opt.step();
    torch_opt.step();
    ours_opt.step();
    for (const auto& [name, p] : our_params) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(is_dtensor(p));
      const at::Tensor whole_ours = whole(p);
      EXPECT_TRUE(close_to_scale(whole_ours, whole(torch_params.at(name)), 1e-12));
      EXPECT_TRUE(close_to_scale(whole_ours, one_params.at(name).detach(), 1e-9));
      // The moments keep the parameter's layout (checkpoints save them as it).
      EXPECT_EQ(placements(state_of(ours_opt, p).exp_avg()), placements(p));
    }
  }
}

TEST(CapturableAdamW, TensorParallelWithSequenceParallelMatchesTorchAdamWAndOneDevice) {
  run_ranks(2, [](int) {
    ParallelizeOptions options;
    options.tp.sequence_parallel = true;
    options.tp.loss_parallel = true;
    expect_parallel_steps_match(init_device_mesh("cpu", {2}), options, true);
  });
}

TEST(CapturableAdamW, FullyShardedOverTensorParallelMatchesTorchAdamWAndOneDevice) {
  run_ranks(4, [](int) {
    ParallelizeOptions options;
    options.fully_shard = true;
    expect_parallel_steps_match(init_device_mesh("cpu", {2, 2}, {"dp", "tp"}), options, false);
  });
}

}  // namespace
