// CaptureRehearsal: ops that would synchronise with the host are reported by name (the outermost
// one only) and with the module they ran in; whole training steps of the Llama model pass it —
// TP 2 with sequence parallelism and the vocab-parallel loss, FSDP 2 x TP 2, and TP 2 in the
// layout-invariant mode — with clipping on the device (clip_grad_norm_on_device_) and
// CapturableAdamW; the same step with an .item() inside a block fails naming the op and block.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "dtensor/comm/capture_rehearsal.h"
#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;
using dtensor::comm::CaptureRehearsal;

namespace {

std::vector<std::string> ops_of(const CaptureRehearsal& r) {
  std::vector<std::string> out;
  for (const auto& s : r.syncs()) out.push_back(s.op);
  return out;
}

TEST(CaptureRehearsal, ReadingAValueFailsNamingTheOutermostOp) {
  CaptureRehearsal rehearsal;
  const at::Tensor x = at::arange(6, at::kFloat);
  (void)(x * 2).sum().item<double>();  // item calls _local_scalar_dense: one report
  EXPECT_EQ(ops_of(rehearsal), std::vector<std::string>{"aten::item"});
  EXPECT_CONTAINS(message_of([&] { rehearsal.check(); }),
                  "capture rehearsal: aten::item would synchronise with the host");
}

TEST(CaptureRehearsal, DataDependentSizesAreReported) {
  CaptureRehearsal rehearsal;
  const at::Tensor x = at::tensor({0.0, 1.0, 0.0, 2.0, 2.0});
  (void)x.nonzero();
  (void)x.masked_select(x > 0);
  (void)at::_unique2(x);
  EXPECT_EQ(ops_of(rehearsal),
            (std::vector<std::string>{"aten::nonzero", "aten::masked_select", "aten::_unique2"}));
  EXPECT_CONTAINS(message_of([&] { rehearsal.check(); }), "3 such ops in all");
}

TEST(CaptureRehearsal, DeviceOpsPassAndTheGuardEndsWithItsScope) {
  {
    CaptureRehearsal rehearsal;
    const at::Tensor x = at::randn({4, 4});
    at::Tensor y = at::mm(x, x).relu_().sum(0);
    y = at::where(y > 0, y, at::zeros_like(y)).clamp(std::nullopt, 1.0);
    // Checked on the device on CUDA (its CPU kernel reads the value: not reported).
    at::_assert_async(y.min() >= 0);
    rehearsal.check();
    EXPECT_TRUE(rehearsal.syncs().empty());
  }
  (void)at::ones({1}).item<float>();  // no rehearsal now: nothing records it
  CaptureRehearsal again;             // and another may start
  EXPECT_TRUE(again.syncs().empty());
}

// ---- training steps ----

DecoderConfig config() {
  DecoderConfig c = DecoderConfig::preset("tiny");
  c.dim = 64;  // the layout-invariant mode's clipping grid needs dims splitting into 2 x 4 blocks
  c.n_kv_heads = 4;
  return c;
}

struct Step {
  Transformer model;
  std::unique_ptr<optim::CapturableAdamW> opt;
  at::Tensor tokens;
  // zero_grad, forward, loss, backward, Partial gradients summed, clipping, optimizer.
  void run() {
    opt->zero_grad();
    loss_and_backward(model->forward(tokens), tokens);
    tp::reduce_partial_grads(*model);
    nn::utils::clip_grad_norm_on_device_(model->parameters(), 0.5);
    opt->step();
  }
};

Step make_step(const DeviceMesh& mesh, const ParallelizeOptions& options, int64_t dp_rank) {
  Step s{Transformer(config()), nullptr, {}};
  s.model->init_weights(7);
  parallelize(*s.model, mesh, options);
  s.opt = std::make_unique<optim::CapturableAdamW>(s.model->parameters(),
                                                   torch::optim::AdamWOptions(1e-2));
  at::manual_seed(3);
  s.tokens = at::randint(config().vocab_size, {4, 8}).narrow(0, 2 * dp_rank, 2);
  return s;
}

// One warm-up step (the optimizer's state is created there, as a captured step's warm-up does),
// then a rehearsed one.
void expect_step_passes(const DeviceMesh& mesh, const ParallelizeOptions& options,
                        int64_t dp_rank) {
  Step s = make_step(mesh, options, dp_rank);
  s.run();
  CaptureRehearsal rehearsal;
  s.run();
  EXPECT_NO_THROW(rehearsal.check());
  for (const auto& sync : rehearsal.syncs()) ADD_FAILURE() << sync.str();
}

TEST(CaptureRehearsal, TensorParallelStepWithSequenceParallelAndLossParallelPasses) {
  run_ranks(2, [](int) {
    ParallelizeOptions options;  // sequence parallel and loss parallel by default
    expect_step_passes(init_device_mesh("cpu", {2}), options, 0);
  });
}

TEST(CaptureRehearsal, FullyShardedOverTensorParallelStepPasses) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    ParallelizeOptions options;
    options.fully_shard = true;
    expect_step_passes(mesh, options, mesh["dp"].get_local_rank());
  });
}

TEST(CaptureRehearsal, LayoutInvariantTensorParallelStepPasses) {
  run_ranks(2, [](int) {
    ops::LayoutInvariantMode invariant(4);
    expect_step_passes(init_device_mesh("cpu", {2}), ParallelizeOptions{}, 0);
  });
}

TEST(CaptureRehearsal, AStepThatReadsAValueFailsNamingTheOpAndModule) {
  run_ranks(2, [](int) {
    Step s = make_step(init_device_mesh("cpu", {2}), ParallelizeOptions{}, 0);
    auto& block = *s.model->blocks().at(1);
    block.register_forward_pre_hook([](torch::nn::Module&, tp::ModuleCall&) {
      (void)at::ones({1}).item<double>();  // e.g. logging a statistic inside the step
    });
    s.run();
    CaptureRehearsal rehearsal;
    s.run();
    EXPECT_CONTAINS(message_of([&] { rehearsal.check(); }),
                    "capture rehearsal: aten::item in module 'layers.1'");
  });
}

}  // namespace
