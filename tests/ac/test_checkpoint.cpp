// Activation checkpointing (dtensor/ac/checkpoint.h): training with AC full and selective matches
// one device in float64 at TP=1 and TP=2; a step issues exactly the collectives it issues
// without AC (the recompute replays them); dropout masks are replayed; a recompute whose
// collectives differ fails naming the module; full AC keeps only each block's input; a drop-in
// layer can be checkpointed and runs plainly under no-grad.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <map>
#include <string>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/memory.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;
using dtensor::ac::ACMode;

namespace {

DecoderConfig tiny() {
  auto c = DecoderConfig::preset("tiny");
  c.vocab_size = 64;
  return c;
}

// The model under test: TP over `mesh` (or none), then AC in `mode`.
Transformer make_model(const DecoderConfig& c, const DeviceMesh* mesh, ACMode mode,
                       std::vector<std::string>* wrapped = nullptr, bool replay = true,
                       bool sequence_parallel = true) {
  Transformer m(c);
  m->to(at::kDouble);
  m->init_weights(11);
  if (mesh) apply_tensor_parallel(*m, *mesh, {.sequence_parallel = sequence_parallel});
  auto w = ac::apply_ac<TransformerBlockImpl>(*m, mode, {.replay_collectives = replay});
  if (wrapped) *wrapped = w;
  return m;
}

// Three AdamW steps against the plain one-device model: loss, every gradient, every parameter.
void expect_training_matches(const DeviceMesh* mesh, ACMode mode, bool replay = true) {
  SCOPED_TRACE(std::string("AC ") + ac::ac_mode_name(mode) + (mesh ? " tp=" : " no TP") +
               (mesh ? std::to_string(mesh->size()) : "") +
               (replay ? "" : " recomputing collectives"));
  const auto c = tiny();
  Transformer ref = make_model(c, nullptr, ACMode::none);
  std::vector<std::string> wrapped;
  Transformer model = make_model(c, mesh, mode, &wrapped, replay);
  const std::vector<std::string> want_wrapped =
      mode == ACMode::full ? std::vector<std::string>{"layers.0", "layers.1"}
                           : std::vector<std::string>{"layers.1"};
  EXPECT_EQ(wrapped, want_wrapped);
  const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW ref_opt(ref->parameters(), opt), opt_ac(model->parameters(), opt);
  const auto ref_params = params_of(*ref), params = params_of(*model);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    auto tokens = at::randint(c.vocab_size, {2, 8}, at::kLong);
    auto targets = at::randint(c.vocab_size, {2, 8}, at::kLong);
    ref_opt.zero_grad();
    opt_ac.zero_grad();
    auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
    auto loss = loss_and_backward(model->forward(tokens), targets);
    reduce_partial_grads(*model);
    EXPECT_TRUE(close_to_scale(loss, ref_loss, 1e-9)) << "loss";
    for (const auto& [name, p] : params) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_TRUE(close_to_scale(whole(p.grad()), ref_params.at(name).grad(), 1e-9)) << "gradient";
    }
    ref_opt.step();
    opt_ac.step();
    for (const auto& [name, p] : params) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(close_to_scale(whole(p), ref_params.at(name), 1e-9))
          << "parameter after the step";
    }
  }
}

}  // namespace

TEST(ActivationCheckpointing, LlamaTrainingMatchesOneDeviceAtTp1AndTp2) {
  for (int tp : {1, 2}) {
    run_ranks(tp, [](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      for (ACMode mode : {ACMode::full, ACMode::selective}) {
        expect_training_matches(&mesh, mode);
        if (mesh.size() == 1) expect_training_matches(nullptr, mode);
      }
      if (mesh.size() > 1) expect_training_matches(&mesh, ACMode::full, /*replay=*/false);
    });
  }
}

// ---- collective counts ----

namespace {

struct StepCounts {
  CommCounts forward, backward;
  CommModuleCounts modules;
  int64_t total = 0;
};

StepCounts count_step(Transformer& model, int64_t vocab) {
  auto tokens = at::randint(vocab, {2, 8}, at::kLong);
  auto targets = at::randint(vocab, {2, 8}, at::kLong);
  StepCounts counts;
  CommDebugMode all;
  CommDebugMode comm;
  auto loss = token_cross_entropy(model->forward(tokens), targets);
  counts.forward = comm.get_comm_counts();
  comm.enter();
  loss.backward();
  counts.backward = comm.get_comm_counts();
  reduce_partial_grads(*model);
  counts.modules = all.comm_module_counts();
  counts.total = all.get_total_counts();
  return counts;
}

}  // namespace

// The recompute replays the forward's collectives: per step, forward and backward issue
// exactly what they issue without AC, per type and per module.
TEST(ActivationCheckpointing, AddsNoCollectives) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const auto c = tiny();
    Transformer plain = make_model(c, &mesh, ACMode::none);
    at::manual_seed(3);
    const StepCounts want = count_step(plain, c.vocab_size);
    EXPECT_GT(want.forward.at(CommType::all_gather_into_tensor), 0);
    for (ACMode mode : {ACMode::full, ACMode::selective}) {
      SCOPED_TRACE(ac::ac_mode_name(mode));
      Transformer model = make_model(c, &mesh, mode);
      at::manual_seed(3);
      const StepCounts got = count_step(model, c.vocab_size);
      EXPECT_EQ(format_comm_counts(got.forward), format_comm_counts(want.forward)) << "forward";
      EXPECT_EQ(format_comm_counts(got.backward), format_comm_counts(want.backward)) << "backward";
      EXPECT_EQ(got.total, want.total);
      for (const auto& [module, phases] : want.modules) {
        SCOPED_TRACE(module);
        for (const auto& [phase, counts] : phases) {
          ASSERT_TRUE(got.modules.count(module) && got.modules.at(module).count(phase)) << phase;
          EXPECT_EQ(format_comm_counts(got.modules.at(module).at(phase)),
                    format_comm_counts(counts))
              << phase;
        }
      }
    }
  });
}

// Without replay, the recompute issues the checkpointed blocks' collectives again: backward
// issues what it issues without AC plus what the blocks' forward issued, per type; the forward
// is unchanged.
TEST(ActivationCheckpointing, WithoutReplayTheRecomputeIssuesTheBlocksCollectivesAgain) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const auto c = tiny();
    for (bool sp : {true, false}) {
      SCOPED_TRACE(sp ? "sequence parallel" : "no sequence parallelism");
      Transformer plain = make_model(c, &mesh, ACMode::none, nullptr, true, sp);
      at::manual_seed(3);
      const StepCounts want = count_step(plain, c.vocab_size);
      Transformer model = make_model(c, &mesh, ACMode::full, nullptr, /*replay=*/false, sp);
      at::manual_seed(3);
      const StepCounts got = count_step(model, c.vocab_size);
      EXPECT_EQ(format_comm_counts(got.forward), format_comm_counts(want.forward));
      CommCounts blocks_forward;
      for (const auto& [module, phases] : want.modules) {
        if (module.rfind("layers.", 0) != 0 || module.find('.', 7) != std::string::npos) continue;
        if (!phases.count("forward")) continue;
        for (const auto& [type, n] : phases.at("forward")) blocks_forward[type] += n;
      }
      ASSERT_FALSE(blocks_forward.empty());
      CommCounts expected = want.backward;
      for (const auto& [type, n] : blocks_forward) expected[type] += n;
      EXPECT_EQ(format_comm_counts(got.backward), format_comm_counts(expected));
    }
  });
}

// ---- random numbers ----

namespace {

// x + down(dropout(gelu(up(x)))): its dropout mask must be the same in the recompute.
struct DropBlockImpl : dtensor::nn::Module {
  dtensor::nn::Linear up{register_module("up", dtensor::nn::Linear(8, 16))};
  dtensor::nn::Dropout drop{register_module("drop", dtensor::nn::Dropout(0.5))};
  dtensor::nn::Linear down{register_module("down", dtensor::nn::Linear(16, 8))};
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& x) { return x + down(drop(at::gelu(up(x)))); }, x);
  }
};
TORCH_MODULE(DropBlock);

struct DropNetImpl : dtensor::nn::Module {
  DropBlock a{register_module("a", DropBlock())};
  DropBlock b{register_module("b", DropBlock())};
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& x) { return b(a(x)); }, x);
  }
};
TORCH_MODULE(DropNet);

DropNet make_drop_net(const DeviceMesh* mesh, bool checkpoint) {
  at::manual_seed(5);
  DropNet net;
  net->to(at::kDouble);
  if (mesh) {
    // The hidden activations stay DTensors, so their dropout draws from DTensor's stream.
    tp::parallelize_module(*net, *mesh,
                           {{"*.up", tp::ColwiseParallel({.use_local_output = false})},
                            {"*.down", tp::RowwiseParallel({.input_layouts = Shard(-1)})}});
  }
  if (checkpoint) {
    ac::checkpoint_wrapper(net->a);
    ac::checkpoint_wrapper(net->b);
  }
  return net;
}

// Loss, gradients, and a draw after the step (the recompute must leave the generators where
// the run without AC leaves them).
struct DropRun {
  at::Tensor loss, after;
  Params grads;
};

DropRun drop_run(const DeviceMesh* mesh, bool checkpoint) {
  DropNet net = make_drop_net(mesh, checkpoint);
  at::manual_seed(9);
  dtensor::manual_seed(9);
  auto x = at::randn({4, 6, 8}, at::kDouble).requires_grad_();
  DropRun r;
  r.loss = net(x).pow(2).sum();
  r.loss.backward();
  for (const auto& [name, p] : params_of(*net)) r.grads[name] = whole(p.grad());
  r.grads["x"] = x.grad();
  r.after = at::rand({4}, at::kDouble);
  if (mesh) {
    r.after = at::cat({r.after, whole(dtensor::rand({4}, *mesh, {Replicate()}, at::kDouble))});
  }
  return r;
}

void expect_same_run(const DeviceMesh* mesh) {
  const DropRun ref = drop_run(mesh, false), got = drop_run(mesh, true);
  EXPECT_TENSOR_EQ(got.loss, ref.loss);
  EXPECT_TENSOR_EQ(got.after, ref.after);
  for (const auto& [name, g] : ref.grads) {
    SCOPED_TRACE(name);
    EXPECT_TENSOR_EQ(got.grads.at(name), g);
  }
  // The masks matter: two calls draw different ones.
  DropNet net = make_drop_net(mesh, false);
  auto x = at::randn({4, 6, 8}, at::kDouble);
  EXPECT_FALSE(at::allclose(net(x), net(x))) << "dropout is not drawing";
}

}  // namespace

TEST(ActivationCheckpointing, RecomputeReplaysDropoutMasks) {
  {
    SCOPED_TRACE("plain tensors (CPU generator)");
    expect_same_run(nullptr);
  }
  run_ranks(2, [](int) {
    SCOPED_TRACE("tp=2 DTensors (DTensor stream)");
    auto mesh = init_device_mesh("cpu", {2});
    expect_same_run(&mesh);
  });
}

// ---- a recompute that does not match its forward ----

namespace {

// Gathers its row-sharded input; `mode` changes what the next call does.
struct FlakyImpl : dtensor::nn::Module {
  DeviceMesh mesh;
  int mode = 0;  // 0: gather all rows, 1: gather the first row only, 2: no collective
  explicit FlakyImpl(DeviceMesh m) : mesh(std::move(m)) {}
  at::Tensor forward(const at::Tensor& x) {
    return call_forward(
        [this](const at::Tensor& x) {
          if (mode == 2) return (x * 3).repeat({2, 1});
          at::Tensor local = mode == 0 ? x : x.narrow(0, 0, 1);
          at::Tensor full = full_tensor(from_local(local * 3, mesh, {Shard(0)}));
          return mode == 0 ? full : full.repeat({2, 1});
        },
        x);
  }
};
TORCH_MODULE(Flaky);

}  // namespace

TEST(ActivationCheckpointing, RecomputeWithOtherCollectivesFailsNamingTheModule) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    Flaky flaky(mesh);
    ac::checkpoint_wrapper(flaky, {"blocks.flaky"});
    EXPECT_TRUE(ac::is_checkpointed(*flaky));
    {
      auto x = at::ones({2, 4}, at::kDouble).requires_grad_();
      flaky(x).sum().backward();  // same collectives: fine
      EXPECT_TENSOR_EQ(x.grad(), at::full({2, 4}, 3.0, at::kDouble));
    }
    for (int mode : {1, 2}) {
      auto x = at::ones({2, 4}, at::kDouble).requires_grad_();
      flaky->mode = 0;
      auto y = flaky(x);
      flaky->mode = mode;
      const std::string msg = message_of([&] { y.sum().backward(); });
      EXPECT_CONTAINS(msg, "the recompute of checkpointed module 'blocks.flaky'");
      if (mode == 1) {
        EXPECT_CONTAINS(msg,
                        "issued collective #1 as all_gather_into_tensor dim 0 of float64[1,4]");
        EXPECT_CONTAINS(msg,
                        "but the forward it recomputes issued all_gather_into_tensor dim 0 of "
                        "float64[2,4] on group");
      } else {
        EXPECT_CONTAINS(msg, "issued 0 collective(s), but the forward it recomputes issued 1");
      }
    }
    ac::remove_checkpoint(*flaky);
    EXPECT_FALSE(ac::is_checkpointed(*flaky));
  });
}

// ---- memory ----

namespace {

struct Memory {
  int64_t held_after_forward;  // bytes kept from the forward for backward (and the loss)
  int64_t peak;                // highest live bytes during forward + backward, above the start
};

Memory measure(int64_t layers, ACMode mode, int64_t batch, int64_t seqlen) {
  auto c = tiny();
  c.n_layers = layers;
  c.max_seq_len = seqlen;
  Transformer m = make_model(c, nullptr, mode);
  auto tokens = at::randint(c.vocab_size, {batch, seqlen}, at::kLong);
  auto targets = at::randint(c.vocab_size, {batch, seqlen}, at::kLong);
  Memory out{};
  {
    CountCpuBytes bytes;
    auto loss = token_cross_entropy(m->forward(tokens), targets);
    out.held_after_forward = bytes.live();
    loss.backward();
    out.peak = bytes.peak();
  }
  return out;
}

}  // namespace

// With full AC a block keeps exactly its input (B*S*dim values; the next block or the final
// norm would keep it anyway as their input, so this is what one more block adds) and the CPU
// generator's state for the recompute. Without AC it keeps every activation its backward needs.
TEST(ActivationCheckpointing, FullAcKeepsOnlyEachBlocksInput) {
  const int64_t B = 4, S = 64;
  const int64_t dim = tiny().dim;
  const int64_t rng_bytes = at::detail::getDefaultCPUGenerator().get_state().numel();
  const Memory none2 = measure(2, ACMode::none, B, S), none4 = measure(4, ACMode::none, B, S);
  const Memory full2 = measure(2, ACMode::full, B, S), full4 = measure(4, ACMode::full, B, S);
  const int64_t per_block_none = (none4.held_after_forward - none2.held_after_forward) / 2;
  const int64_t per_block_full = (full4.held_after_forward - full2.held_after_forward) / 2;
  EXPECT_EQ(per_block_full, B * S * dim * 8 + rng_bytes);
  EXPECT_GT(per_block_none, 8 * per_block_full);
  EXPECT_LT(full4.peak, none4.peak);
  std::cout << "per block kept for backward: " << per_block_none << " bytes without AC, "
            << per_block_full << " with full AC; peak over forward+backward (4 layers, B=" << B
            << ", S=" << S << "): " << none4.peak << " without AC, " << full4.peak
            << " with full AC\n";
}

// A drop-in layer can be checkpointed as it is; under no-grad it runs without the Function.
TEST(ActivationCheckpointing, WrapsADtensorNnLayerAndRunsPlainUnderNoGrad) {
  dtensor::nn::Linear ref(4, 3), layer(4, 3);
  ref->to(at::kDouble);
  layer->to(at::kDouble);
  {
    at::NoGradGuard no_grad;
    layer->weight.copy_(ref->weight);
    layer->bias.copy_(ref->bias);
  }
  ac::checkpoint_wrapper(layer);
  auto x = at::randn({2, 4}, at::kDouble).requires_grad_();
  auto x2 = x.detach().clone().requires_grad_();
  ref(x).pow(2).sum().backward();
  auto y = layer(x2);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_CONTAINS(y.grad_fn()->name(), "CheckpointFunction");
  y.pow(2).sum().backward();
  EXPECT_TENSOR_EQ(layer->weight.grad(), ref->weight.grad());
  EXPECT_TENSOR_EQ(layer->bias.grad(), ref->bias.grad());
  EXPECT_TENSOR_EQ(x2.grad(), x.grad());
  at::NoGradGuard no_grad;
  auto z = layer(x2);
  EXPECT_FALSE(z.requires_grad());
  EXPECT_TENSOR_EQ(z, ref(x));
}
