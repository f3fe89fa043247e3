// Mixture-of-experts blocks against transformers (tests/fixtures/hf/make_moe_fixtures.py): the
// first sparse layer's block of a Qwen3-MoE, a Mixtral and a gpt-oss checkpoint, run on the hidden
// states HF's own forward handed it, routes like HF (same experts, weights within 1e-6), outputs
// HF's float32 values within 1e-5 and its bfloat16 values bit for bit, and gives HF's gradients of
// sum(y * upstream) + coef * aux loss for the router, the experts and the input; the auxiliary loss
// of a training batch's routers equals HF's; the grouped product and the loop give the same bits
// forward and backward; in LayoutInvariantMode a token's output bits do not depend on how many
// other tokens chose its experts. With the experts split over TP 2 and 4 ranks, three AdamW steps
// of a float64 block (loss with the auxiliary loss) give one device's loss, every gradient and
// every parameter within 1e-9, with one all-reduce forward, one backward and one for the
// router's (and b2's) Partial gradients; under FSDP 2 x TP 2 the auxiliary loss pooled over dp is
// the whole batch's, and the step one device's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <map>
#include <optional>
#include <string>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/core/api.h"
#include "dtensor/fsdp/fully_shard.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/hf_experts.h"
#include "dtensor/models/moe.h"
#include "dtensor/ops/layout_invariant.h"
#include "dtensor/tp/partial_grads.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/model_compare.h"
#include "support/moe_blocks.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;
namespace safetensors = dtensor::checkpoint::safetensors;

namespace {

const std::string kModels = std::string(DTENSOR_HF_FIXTURES) + "/moe_models/";

struct Family {
  std::string name;
  HfExpertLayout layout;
  MoeOptions options;
  int64_t hidden_dim;  // the experts' I
  double aux_coef;     // router_aux_loss_coef
};

void PrintTo(const Family& f, std::ostream* os) { *os << f.name; }

std::vector<Family> families() {
  MoeOptions qwen{.num_experts = 8, .top_k = 2, .renormalize = true};
  MoeOptions mixtral{.num_experts = 4, .top_k = 2, .renormalize = true, .float32_weights = true};
  MoeOptions gpt_oss{.num_experts = 4,
                     .top_k = 2,
                     .scoring = RouterScoring::kTopKThenSoftmax,
                     .router_bias = true,
                     .expert_bias = true,
                     .activation = ExpertActivation::kClampedSwiGLU,
                     .swiglu_limit = 1.0};
  return {{"qwen3_moe", kQwen3MoeExperts, qwen, 16, 0.01},
          {"mixtral", kMixtralExperts, mixtral, 16, 0.02},
          {"gpt_oss", kGptOssExperts, gpt_oss, 32, 0.01}};
}

std::map<std::string, at::Tensor> reference(const std::string& name) {
  return safetensors::load_file(kModels + name + "/reference.safetensors");
}

// The first sparse layer's (layer 0's) router and experts of a fixture, in `dtype`.
struct Block {
  at::Tensor router_weight, router_bias;
  ExpertWeights experts;
};

Block load_block(const Family& f, c10::ScalarType dtype) {
  safetensors::File file(kModels + f.name + "/model.safetensors");
  HfTensorSource source{[&](const std::string& n) { return file.find(n) != nullptr; },
                        [&](const std::string& n) {
                          return std::pair{&file, &file.at(n)};
                        }};
  const int64_t E = f.options.num_experts, I = f.hidden_dim, H = 32;
  uint64_t bytes = 0;
  auto part = [&](ExpertParam p, std::vector<int64_t> shape) {
    const std::vector<int64_t> zero(shape.size(), 0);
    return read_expert_part(source, f.layout, 0, p, shape, zero, shape, dtype, "test", &bytes)
        .to(dtype);
  };
  Block b;
  const std::string router = hf_expert_prefix(f.layout, 0) + f.layout.router;
  b.router_weight = file.tensor(router + ".weight").to(dtype);
  if (f.options.router_bias) b.router_bias = file.tensor(router + ".bias").to(dtype);
  b.experts.w1 = part(ExpertParam::kW1, {E, I, H});
  b.experts.w3 = part(ExpertParam::kW3, {E, I, H});
  b.experts.w2 = part(ExpertParam::kW2, {E, H, I});
  if (f.options.expert_bias) {
    b.experts.b1 = part(ExpertParam::kB1, {E, I});
    b.experts.b3 = part(ExpertParam::kB3, {E, I});
    b.experts.b2 = part(ExpertParam::kB2, {E, H});
  }
  return b;
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, double rtol,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const double scale = std::max(expected.abs().max().item<double>(), 1e-30);
  const double err = (actual.to(at::kDouble) - expected.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(err, rtol * scale) << what << ": max |error| " << err << " of max " << scale;
}

class MoeMatchesHF : public ::testing::TestWithParam<Family> {};

TEST_P(MoeMatchesHF, RoutingOutputAndGradientsInFloat32) {
  const Family f = GetParam();
  auto ref = reference(f.name);
  Block b = load_block(f, at::kFloat);
  std::vector<at::Tensor> params{b.router_weight, b.experts.w1, b.experts.w2, b.experts.w3};
  for (at::Tensor* t : {&b.router_bias, &b.experts.b1, &b.experts.b2, &b.experts.b3})
    if (t->defined()) params.push_back(*t);
  for (auto& p : params) p.requires_grad_(true);
  const at::Tensor x = ref.at("block.x").clone().requires_grad_(true);

  const Routing r = route(x, b.router_weight, b.router_bias, f.options);
  expect_close(r.logits, ref.at("block.router_logits"), 1e-6, "router logits");
  EXPECT_TRUE(at::equal(r.experts, ref.at("block.top_k_index"))) << "chosen experts";
  expect_close(r.weights, ref.at("block.top_k_weights"), 1e-6, "routing weights");
  EXPECT_EQ(r.weights.scalar_type(), at::kFloat);

  const at::Tensor y = experts_forward(x, r, b.experts, f.options);
  expect_close(y, ref.at("block.y"), 1e-5, "block output");
  const at::Tensor aux = load_balancing_loss({r.logits}, f.options.num_experts, f.options.top_k);
  expect_close(aux, ref.at("block.aux_loss"), 1e-6, "aux loss");
  const at::Tensor loss = (y * ref.at("block.upstream")).sum() + f.aux_coef * aux;
  expect_close(loss, ref.at("block.loss"), 1e-5, "loss");
  loss.backward();

  expect_close(x.grad(), ref.at("block.grad.x"), 1e-5, "input gradient");
  const std::string router = f.layout.router;
  expect_close(b.router_weight.grad(), ref.at("block.grad." + router + ".weight"), 1e-5,
               "router weight gradient");
  if (b.router_bias.defined())
    expect_close(b.router_bias.grad(), ref.at("block.grad." + router + ".bias"), 1e-5,
                 "router bias gradient");
  if (f.layout.gate != nullptr) {
    // transformers keeps gate and up concatenated in memory: [E, 2I, H].
    expect_close(at::cat({b.experts.w1.grad(), b.experts.w3.grad()}, 1),
                 ref.at("block.grad.experts.gate_up_proj"), 1e-5, "gate/up gradient");
    expect_close(b.experts.w2.grad(), ref.at("block.grad.experts.down_proj"), 1e-5,
                 "down gradient");
  } else {
    // gpt-oss's memory layout is its file layout.
    const ExpertWeights grads{b.experts.w1.grad(), b.experts.w2.grad(), b.experts.w3.grad(),
                              b.experts.b1.grad(), b.experts.b2.grad(), b.experts.b3.grad()};
    for (const auto& [name, g] : hf_expert_tensors(f.layout, 0, grads)) {
      const std::string key = "block.grad.experts." + name.substr(name.rfind('.') + 1);
      expect_close(g, ref.at(key), 1e-5, key);
    }
  }
}

TEST_P(MoeMatchesHF, BlockInBfloat16IsHFsBitForBit) {
  const Family f = GetParam();
  auto ref = reference(f.name);
  const Block b = load_block(f, at::kBFloat16);
  const at::Tensor x = ref.at("block.x_bf16");
  const Routing r = route(x, b.router_weight, b.router_bias, f.options);
  for (ExpertCompute compute : {ExpertCompute::kGroupedMm, ExpertCompute::kLoop}) {
    MoeOptions o = f.options;
    o.compute = compute;
    const at::Tensor y = experts_forward(x, r, b.experts, o);
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(y, ref.at("block.y_bf16")))
        << (compute == ExpertCompute::kLoop ? "loop" : "grouped") << ": max |error| "
        << (y.to(at::kFloat) - ref.at("block.y_bf16").to(at::kFloat)).abs().max().item<float>();
  }
}

INSTANTIATE_TEST_SUITE_P(Families, MoeMatchesHF, ::testing::ValuesIn(families()),
                         [](const auto& info) { return info.param.name; });

TEST(Moe, NormTopkProbFalseKeepsTheSoftmaxProbabilities) {
  Family f = families()[0];
  f.options.renormalize = false;
  auto ref = reference(f.name);
  const Block b = load_block(f, at::kFloat);
  const Routing r = route(ref.at("block.x"), b.router_weight, {}, f.options);
  expect_close(r.weights, ref.at("block.top_k_weights_unnormed"), 1e-6, "routing weights");
  EXPECT_TRUE((r.weights.sum(-1) < 1).all().item<bool>());
}

TEST(Moe, AuxLossOverTheSparseLayersOfATrainingBatchEqualsHF) {
  for (const Family& f : families()) {
    auto ref = reference(f.name);
    const at::Tensor logits = ref.at("train.router_logits");  // (sparse layers, T, E)
    const std::vector<at::Tensor> layers = logits.unbind(0);
    const at::Tensor aux = load_balancing_loss(layers, f.options.num_experts, f.options.top_k);
    // The same float32 operations in the same order: HF's value to the last bit or two.
    expect_close(aux, ref.at("train.aux_loss"), 1e-6, f.name + " aux loss");
    // Not the mean of the layers' own losses: the counts and probabilities are pooled first.
    if (layers.size() > 1) {
      const double separate =
          (load_balancing_loss({layers[0]}, f.options.num_experts, f.options.top_k) +
           load_balancing_loss({layers[1]}, f.options.num_experts, f.options.top_k))
              .item<double>() /
          2;
      EXPECT_GT(std::abs(separate - aux.item<double>()), 1e-6) << f.name;
    }
  }
}

TEST(Moe, GroupedProductAndLoopGiveTheSameBitsForwardAndBackward) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const Family& f : families()) {
      at::manual_seed(3);
      const Block b = load_block(f, dtype);
      const at::Tensor x0 = at::randn({37, 32}).to(dtype);
      std::map<ExpertCompute, std::vector<at::Tensor>> results;
      for (ExpertCompute compute : {ExpertCompute::kGroupedMm, ExpertCompute::kLoop}) {
        MoeOptions o = f.options;
        o.compute = compute;
        ExpertWeights w = b.experts;
        for (at::Tensor* t : {&w.w1, &w.w2, &w.w3, &w.b1, &w.b2, &w.b3})
          if (t->defined()) *t = t->detach().clone().requires_grad_(true);
        const at::Tensor x = x0.clone().requires_grad_(true);
        const Routing r = route(x, b.router_weight, b.router_bias, o);
        const at::Tensor y = experts_forward(x, r, w, o);
        y.backward(at::ones_like(y));
        results[compute] = {y, x.grad(), w.w1.grad(), w.w2.grad(), w.w3.grad()};
      }
      for (size_t i = 0; i < results[ExpertCompute::kLoop].size(); ++i)
        EXPECT_TRUE(
            at::equal(results[ExpertCompute::kGroupedMm][i], results[ExpertCompute::kLoop][i]))
            << f.name << " " << dtype << " result " << i;
    }
  }
}

TEST(Moe, GroupedProductIsRefusedWhereItsKernelDoesNotRun) {
  MoeOptions o{.num_experts = 4, .top_k = 2, .compute = ExpertCompute::kGroupedMm};
  GroupedExperts narrow(/*dim=*/30, /*hidden_dim=*/10, o);  // rows of 120 and 40 bytes
  EXPECT_ERROR(expert_compute_for(narrow->weights(), at::kFloat, o), c10::Error,
               "grouped product does not run", "hidden size 30", "expert width 10");
  o.compute = ExpertCompute::kAuto;
  EXPECT_EQ(expert_compute_for(narrow->weights(), at::kFloat, o), ExpertCompute::kLoop);
  GroupedExperts wide(32, 16, o);
  EXPECT_EQ(expert_compute_for(wide->weights(), at::kFloat, o), ExpertCompute::kGroupedMm);
  EXPECT_EQ(expert_compute_for(wide->weights(), at::kDouble, o), ExpertCompute::kLoop);
  ops::LayoutInvariantMode mode(4);
  EXPECT_EQ(expert_compute_for(wide->weights(), at::kFloat, o), ExpertCompute::kLoop);
}

TEST(Moe, InLayoutInvariantModeATokensBitsDoNotDependOnItsExpertsOtherTokens) {
  // Each token alone gives the router and its experts 1 row; in the whole batch they get several.
  // This LibTorch multiplies 1-3 rows on another kernel path; the mode pads them to 4. One
  // intra-op thread, as each rank runs (with two, a product's rows past the first 4 are split
  // between the threads by their number).
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  for (bool invariant : {false, true}) {
    std::optional<ops::LayoutInvariantMode> mode;
    if (invariant) mode.emplace(4);
    int64_t differ = 0;
    for (const Family& f : families()) {
      auto ref = reference(f.name);
      const Block b = load_block(f, at::kFloat);
      const at::Tensor x = ref.at("block.x");
      const at::Tensor all = experts_forward(x, route(x, b.router_weight, b.router_bias, f.options),
                                             b.experts, f.options);
      for (int64_t t = 0; t < x.size(0); ++t) {
        const at::Tensor one = x.narrow(0, t, 1);
        const at::Tensor alone = experts_forward(
            one, route(one, b.router_weight, b.router_bias, f.options), b.experts, f.options);
        differ += at::equal(alone, all.narrow(0, t, 1)) ? 0 : 1;
      }
    }
    if (invariant) {
      EXPECT_EQ(differ, 0) << "tokens whose bits depend on the others";
    } else {
      EXPECT_GT(differ, 0) << "the control: without the mode some tokens differ";
    }
  }
  at::set_num_threads(threads);
}

TEST(Moe, SparseLayersFollowDecoderSparseStepAndMlpOnlyLayers) {
  EXPECT_EQ(sparse_layers(3, 8, 1, {1}), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(sparse_layers(4, 8, 2, {}), (std::vector<bool>{false, true, false, true}));
  EXPECT_EQ(sparse_layers(4, 8, 2, {3}), (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(sparse_layers(2, 0, 1, {}), (std::vector<bool>{false, false}));
  EXPECT_ERROR(sparse_layers(2, 8, 1, {2}), c10::Error, "mlp_only_layers holds 2");
}

TEST(Moe, OptionsRefuseTopKAboveNumExperts) {
  MoeOptions o{.num_experts = 8, .top_k = 9};
  EXPECT_ERROR(o.validate(), c10::Error, "top_k (num_experts_per_tok) 9", "[1, num_experts=8]");
}

TEST(Moe, ModuleRoutesEveryTokenAndKeepsItsRouterLogits) {
  MoeOptions o{.num_experts = 4, .top_k = 2, .renormalize = true};
  MoE moe(32, 16, o);
  const at::Tensor x = at::randn({2, 5, 32});
  const at::Tensor y = moe->forward(x);
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(moe->last_router_logits().sizes(), (std::vector<int64_t>{10, 4}));
  EXPECT_EQ(moe->last_tokens_per_expert().sum().item<int64_t>(), 20);
  EXPECT_EQ(moe->named_parameters().size(), 4u);  // router.weight, experts.w1, w2, w3
  load_balancing_loss({moe->last_router_logits()}, 4, 2).backward();
  EXPECT_TRUE(moe->router->weight.grad().defined());
}

// ---- tensor parallelism ----

TEST(MoeTp, ThreeAdamWStepsAtTp2And4EqualOneDevice) {
  for (int tp : {2, 4}) {
    run_ranks(tp, [](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      for (const MoeOptions& o : moe_variants()) {
        SCOPED_TRACE(c10::str("tp=", mesh.size(), " experts=", o.num_experts));
        MoE ref = seeded_block(o, 5), moe = seeded_block(o, 5);
        apply_tensor_parallel(*moe, mesh);
        EXPECT_TRUE(is_dtensor(moe->experts->w1) && is_dtensor(moe->router->weight));
        torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
        torch::optim::AdamW opt(moe->parameters(), torch::optim::AdamWOptions(1e-2));
        at::manual_seed(9);
        const at::Tensor x0 = at::randn({2, 6, 32}, at::kDouble);
        const at::Tensor upstream = at::randn({2, 6, 32}, at::kDouble);
        for (int step = 0; step < 3; ++step) {
          SCOPED_TRACE(c10::str("step ", step));
          at::Tensor losses[2], inputs[2];
          MoE* blocks[] = {&ref, &moe};
          for (int i = 0; i < 2; ++i) {
            inputs[i] = x0.clone().requires_grad_(true);
            const at::Tensor y = (*blocks[i])->forward(inputs[i]);
            const at::Tensor aux =
                load_balancing_loss({(*blocks[i])->last_router_logits()}, o.num_experts, o.top_k);
            losses[i] = (y * upstream).sum() + 0.1 * aux;
          }
          ref_opt.zero_grad();
          opt.zero_grad();
          losses[0].backward();
          CommDebugMode comm;
          losses[1].backward();
          const CommCounts backward = comm.get_comm_counts();
          comm.enter();
          tp::reduce_partial_grads(*moe);
          EXPECT_EQ(format_comm_counts(comm.get_comm_counts()),
                    format_comm_counts({{CommType::all_reduce, 1}}))
              << "reduce_partial_grads: the router's (and b2's) gradients in one all-reduce";
          EXPECT_EQ(format_comm_counts(backward), format_comm_counts({{CommType::all_reduce, 1}}))
              << "backward: the input's gradient";
          EXPECT_NEAR(losses[1].item<double>(), losses[0].item<double>(), 1e-9);
          EXPECT_TRUE(close_to_scale(inputs[1].grad(), inputs[0].grad(), 1e-9)) << "input grad";
          expect_like_one_device(moe, ref, /*after_step=*/false);
          ref_opt.step();
          opt.step();
          expect_like_one_device(moe, ref, /*after_step=*/true);
        }
      }
    });
  }
}

TEST(MoeTp, ReplicatedExpertsInLayoutInvariantModeGiveOneDevicesBitsAtTp2And4) {
  for (int tp : {2, 4}) {
    run_ranks(tp, [](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      ops::LayoutInvariantMode mode(4);
      for (const MoeOptions& o : moe_variants()) {
        SCOPED_TRACE(c10::str("tp=", mesh.size(), " experts=", o.num_experts));
        MoE ref = seeded_block(o, 5), moe = seeded_block(o, 5);
        ref->to(at::kFloat);
        moe->to(at::kFloat);
        apply_tensor_parallel(*moe, mesh, {.replicate_experts = true});
        at::manual_seed(9);
        const at::Tensor x0 = at::randn({2, 6, 32});
        const at::Tensor upstream = at::randn({2, 6, 32});
        at::Tensor outputs[2], inputs[2];
        MoE* blocks[] = {&ref, &moe};
        CommDebugMode comm;
        for (int i = 0; i < 2; ++i) {
          inputs[i] = x0.clone().requires_grad_(true);
          outputs[i] = (*blocks[i])->forward(inputs[i]);
          const at::Tensor aux =
              load_balancing_loss({(*blocks[i])->last_router_logits()}, o.num_experts, o.top_k);
          ((outputs[i] * upstream).sum() + 0.1 * aux).backward();
        }
        EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
        EXPECT_TRUE(at::equal(outputs[1], outputs[0]));
        EXPECT_TRUE(at::equal(inputs[1].grad(), inputs[0].grad()));
        const auto rp = params_of(*ref);
        for (const auto& [name, p] : params_of(*moe))
          EXPECT_TRUE(at::equal(whole(p.grad()), rp.at(name).grad())) << name;
      }
    });
  }
}

// FSDP over 2 dp ranks on top of TP 2 (4 ranks): each dp rank runs half of the batch, its loss
// the mean over its tokens plus the auxiliary loss pooled over dp (the whole batch's, as one
// device computes it); FSDP's average of the gradients is then one device's over the whole
// batch. Per step: forward one all-gather of the block's shards (kept for the backward: the block
// is its root unit), one all-reduce of the output (tp) and one of the routers' statistics (dp);
// backward one all-reduce of the input's gradient and one of each Partial gradient (tp), one
// reduce-scatter of the gradients (dp).
TEST(MoeTp, ThreeAdamWStepsAtFsdp2xTp2WithTheWholeBatchsAuxLossEqualOneDevice) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const int64_t dp_rank = mesh.get_local_rank("dp");
    for (const MoeOptions& o : moe_variants()) {
      SCOPED_TRACE(c10::str("experts=", o.num_experts));
      MoE ref = seeded_block(o, 5), moe = seeded_block(o, 5);
      apply_tensor_parallel(*moe, mesh);
      fsdp::fully_shard(*moe, mesh["dp"]);
      torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW opt(moe->parameters(), torch::optim::AdamWOptions(1e-2));
      at::manual_seed(9);
      const at::Tensor x0 = at::randn({4, 6, 32}, at::kDouble);
      const at::Tensor upstream = at::randn({4, 6, 32}, at::kDouble);
      // The mean of y * upstream over the tokens of `rows` plus 0.1 times the auxiliary loss;
      // `aux` gets the latter's value.
      auto loss_of = [&](MoE& block, int64_t first, int64_t rows, at::Tensor& input,
                         const std::optional<DeviceMesh>& dp, double& aux) {
        input = x0.narrow(0, first, rows).clone().requires_grad_(true);
        const at::Tensor y = block->forward(input);
        const at::Tensor a =
            load_balancing_loss({block->last_router_logits()}, o.num_experts, o.top_k, dp);
        aux = a.item<double>();
        return (y * upstream.narrow(0, first, rows)).sum() / (rows * 6) + 0.1 * a;
      };
      for (int step = 0; step < 3; ++step) {
        SCOPED_TRACE(c10::str("step ", step));
        ref_opt.zero_grad();
        opt.zero_grad();
        at::Tensor ref_input, input;
        double ref_aux = 0, aux = 0;
        const at::Tensor ref_loss = loss_of(ref, 0, 4, ref_input, std::nullopt, ref_aux);
        ref_loss.backward();
        CommDebugMode comm;
        const at::Tensor loss = loss_of(moe, 2 * dp_rank, 2, input, mesh["dp"], aux);
        const CommCounts forward = comm.get_comm_counts();
        CommDebugMode comm2;
        loss.backward();
        const CommCounts backward = comm2.get_comm_counts();
        CommDebugMode comm3;
        tp::reduce_partial_grads(*moe);
        EXPECT_EQ(
            format_comm_counts(forward),
            format_comm_counts({{CommType::all_gather_into_tensor, 1}, {CommType::all_reduce, 2}}))
            << "forward: the shards, the output (tp), the routers' statistics (dp)";
        // The router's weight, with biases also the router's bias and b2.
        const int64_t partial = o.expert_bias ? 3 : 1;
        EXPECT_EQ(format_comm_counts(backward),
                  format_comm_counts(
                      {{CommType::all_reduce, 1 + partial}, {CommType::reduce_scatter_tensor, 1}}))
            << "backward: the input's gradient and each Partial gradient (tp), the gradients (dp)";
        EXPECT_EQ(comm3.get_total_counts(), 0) << "FSDP's backward summed the Partial gradients";
        EXPECT_NEAR(aux, ref_aux, 1e-12) << "every rank's auxiliary loss is the whole batch's";
        // The ranks' losses average to one device's.
        const at::Tensor mean =
            comm::all_reduce(loss.detach().reshape({1}), ReduceOp::Sum, mesh["dp"].group(0)) / 2;
        EXPECT_NEAR(mean.item<double>(), ref_loss.item<double>(), 1e-9);
        // The input's gradient is that of this rank's half in the averaged loss.
        EXPECT_TRUE(
            close_to_scale(input.grad() / 2, ref_input.grad().narrow(0, 2 * dp_rank, 2), 1e-9));
        expect_like_one_device(moe, ref, /*after_step=*/false);
        ref_opt.step();
        opt.step();
        expect_like_one_device(moe, ref, /*after_step=*/true);
      }
    }
  });
}

TEST(MoeTp, ForwardIssuesOneAllReduce) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    MoE moe = seeded_block(moe_variants()[0], 3);
    apply_tensor_parallel(*moe, mesh);
    CommDebugMode comm;
    moe->forward(at::randn({2, 4, 32}, at::kDouble));
    EXPECT_EQ(format_comm_counts(comm.get_comm_counts()),
              format_comm_counts({{CommType::all_reduce, 1}}));
  });
}

TEST(MoeTp, RefusesWidthsThatDoNotSplitAndTheLayoutInvariantModeAtTpAbove1) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    MoE narrow(32, 6, MoeOptions{.num_experts = 4, .top_k = 2});
    EXPECT_ERROR(apply_tensor_parallel(*narrow, mesh), c10::Error, "experts' width 6",
                 "not divisible by tp=4");
    MoE moe = seeded_block(moe_variants()[0], 3);
    apply_tensor_parallel(*moe, mesh);
    ops::LayoutInvariantMode mode(4);
    EXPECT_ERROR(moe->forward(at::randn({1, 4, 32}, at::kDouble)), c10::Error,
                 "LayoutInvariantMode", "tp=4");
  });
}

}  // namespace
