// Hugging Face checkpoints of the other decoder families, made by transformers itself
// (tests/fixtures/hf/make_family_fixtures.py): Qwen3 (head_dim 8 != 48 / 12, q/k norms, 2 KV heads
// replicated at TP 3 and 4), Qwen2 (9 heads / 3 KV heads at the odd TP=3, q/k/v biases, tied
// embedding, a sliding window of 5 on layer 1 only, transformers 4's config spelling) and Mistral
// (sliding window 5 on every layer) and Gemma 3 (Gemma3ForCausalLM: (1 + w) norms before and after
// each sublayer, q/k norms, GeGLU, embeddings times sqrt(hidden), query_pre_attn_scalar 24 !=
// head_dim 16, tied embedding, 3 layers sliding/full/sliding with a window of 5 and their own rope
// bases, 2 KV heads replicated at TP 4). Each gives HF's float32 logits within 1e-5 and, loaded in
// float64, its float64 logits within 1e-12 at every TP degree its heads allow, and loaded in
// bfloat16 HF's own bfloat16 logits, bit for bit at TP=1; greedy generation
// equals HF's generate() token for token past the window, and a batch of prompts of different
// lengths equals each alone; the q/k-norm and bias gradients at TP > 1 equal one device's;
// saving from TP=2 writes back the very tensors and config; bad input is refused naming the file,
// the key (and its value) or the tensor.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/dtensor.h"
#include "dtensor/models/generate.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/models/transformer_stage.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/fixture_copy.h"
#include "support/temp_dir.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;
namespace safetensors = dtensor::checkpoint::safetensors;
namespace fs = std::filesystem;

namespace {

const std::string kModels = std::string(DTENSOR_HF_FIXTURES) + "/family_models/";

auto reference(const std::string& name) {
  return safetensors::load_file(kModels + name + "/reference.safetensors");
}

struct Case {
  std::string family;
  int tp;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.family << " tp=" << c.tp; }

// The TP degrees each fixture's heads allow: Qwen2 has 9 heads, Gemma 3 4.
std::vector<Case> cases() {
  return {{"qwen3", 1},  {"qwen3", 2},   {"qwen3", 3},   {"qwen3", 4},   {"qwen2", 1},
          {"qwen2", 3},  {"mistral", 1}, {"mistral", 2}, {"mistral", 3}, {"mistral", 4},
          {"gemma3", 1}, {"gemma3", 2},  {"gemma3", 4}};
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.family + "_tp" + std::to_string(info.param.tp);
}

class FamilyMatchesHF : public ::testing::TestWithParam<Case> {};

TEST_P(FamilyMatchesHF, LogitsInFloat32AndFloat64) {
  const Case c = GetParam();
  const auto ref = reference(c.family);
  run_ranks(c.tp, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {c.tp});
    for (const auto& [dtype, key, tolerance] :
         {std::tuple{at::kFloat, "logits", 1e-5}, std::tuple{at::kDouble, "logits_f64", 1e-12}}) {
      HfModel hf = load_hf(kModels + c.family, mesh, {.dtype = dtype});
      at::Tensor logits;
      {
        at::NoGradGuard no_grad;
        logits = hf.model->forward(ref.at("tokens"));
        if (is_dtensor(logits)) logits = full_tensor(logits);
      }
      const at::Tensor& want = ref.at(key);
      ASSERT_EQ(logits.scalar_type(), want.scalar_type());
      const double scale = want.abs().max().item<double>();
      EXPECT_GT(scale, 0.5);
      const double error = (logits - want).abs().max().item<double>() / scale;
      EXPECT_LE(error, tolerance) << c.family << " " << dtype;
      if (rank == 0)
        std::cout << c.family << " tp=" << c.tp << " " << dtype
                  << ": max |logits - HF| / max |HF| = " << error << "\n";
    }
  });
}

TEST_P(FamilyMatchesHF, GreedyGenerationPastTheWindow) {
  const Case c = GetParam();
  const auto ref = reference(c.family);
  const at::Tensor tokens = ref.at("tokens"), greedy = ref.at("greedy");
  run_ranks(c.tp, [&](int) {
    auto mesh = init_device_mesh("cpu", {c.tp});
    HfModel hf = load_hf(kModels + c.family, mesh, {.dtype = at::kFloat});
    GenerateOptions options;
    options.max_new_tokens = greedy.size(1);
    std::vector<std::vector<int64_t>> alone;
    for (int64_t b = 0; b < tokens.size(0); ++b) {
      const at::Tensor row = tokens[b].contiguous();
      const std::vector<int64_t> prompt(row.data_ptr<int64_t>(),
                                        row.data_ptr<int64_t>() + row.numel());
      const at::Tensor want = greedy[b].contiguous();
      const std::vector<int64_t> expected(want.data_ptr<int64_t>(),
                                          want.data_ptr<int64_t>() + want.numel());
      alone.push_back(generate(*hf.model, {prompt}, options).tokens[0]);
      EXPECT_EQ(alone.back(), expected) << c.family << " prompt " << b;
    }
    // Different lengths in one batch (left padding, windows counted in positions) give each
    // prompt's own tokens.
    const at::Tensor r0 = tokens[0].contiguous(), r1 = tokens[1].narrow(0, 0, 7).contiguous();
    const std::vector<int64_t> p0(r0.data_ptr<int64_t>(), r0.data_ptr<int64_t>() + r0.numel());
    const std::vector<int64_t> p1(r1.data_ptr<int64_t>(), r1.data_ptr<int64_t>() + r1.numel());
    const auto batch = generate(*hf.model, {p0, p1}, options).tokens;
    EXPECT_EQ(batch[0], alone[0]);
    EXPECT_EQ(batch[1], generate(*hf.model, {p1}, options).tokens[0]);
  });
}

// Loaded in bfloat16, the logits are HF's own bfloat16 forward's (sdpa): at TP=1 bit for bit
// (norms, rotary tables and biases rounded where HF rounds them); at TP > 1 the row-parallel
// products are rounded to bfloat16 on each rank before their sum, as PyTorch's TP rounds them, and
// must stay nearer HF's bfloat16 logits than those are to HF's float32 ones.
TEST_P(FamilyMatchesHF, LogitsInBfloat16) {
  const Case c = GetParam();
  const auto ref = reference(c.family);
  const at::Tensor want = ref.at("logits_bf16").to(at::kFloat);
  const double scale = want.abs().max().item<double>();
  const double bf16_vs_f32 = (want - ref.at("logits")).abs().max().item<double>() / scale;
  run_ranks(c.tp, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {c.tp});
    HfModel hf = load_hf(kModels + c.family, mesh, {.dtype = at::kBFloat16});
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = hf.model->forward(ref.at("tokens"));
      if (is_dtensor(logits)) logits = full_tensor(logits);
    }
    ASSERT_EQ(logits.scalar_type(), at::kBFloat16);
    const double error = (logits.to(at::kFloat) - want).abs().max().item<double>() / scale;
    if (c.tp == 1)
      EXPECT_TRUE(at::equal(logits, ref.at("logits_bf16"))) << c.family << " error " << error;
    else
      EXPECT_LT(error, bf16_vs_f32) << c.family << " tp=" << c.tp;
    if (rank == 0)
      std::cout << c.family << " tp=" << c.tp
                << " bfloat16: max |logits - HF| / max |HF| = " << error
                << " (HF bf16 vs HF f32: " << bf16_vs_f32 << ")\n";
  });
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FamilyMatchesHF, ::testing::ValuesIn(cases()), case_name);

// Gradients of every parameter (the q/k norms' replicated weights, whose local heads each give
// part of the gradient, and the biases sharded with their projections included) after
// reduce_partial_grads equal one device's, in float64.
class FamilyGradients : public ::testing::TestWithParam<Case> {};

std::map<std::string, at::Tensor> gradients(const std::string& family,
                                            const std::optional<DeviceMesh>& mesh) {
  const auto ref = reference(family);
  HfModel hf = load_hf(kModels + family, mesh, {.dtype = at::kDouble});
  const at::Tensor tokens = ref.at("tokens");
  const at::Tensor targets = at::roll(tokens, -1, 1);
  loss_and_backward(hf.model->forward(tokens), targets);
  reduce_partial_grads(*hf.model);
  std::map<std::string, at::Tensor> out;
  for (const auto& p : hf.model->named_parameters()) {
    const at::Tensor g = p.value().grad();
    out[p.key()] = is_dtensor(g) ? full_tensor(g) : g;
  }
  return out;
}

TEST_P(FamilyGradients, EqualOneDevice) {
  const Case c = GetParam();
  const auto want = gradients(c.family, std::nullopt);
  int norms = 0, biases = 0;
  for (const auto& [name, g] : want) {
    norms += name.find("attention.q_norm") != std::string::npos ||
             name.find("attention.k_norm") != std::string::npos;
    biases += name.ends_with(".bias");
  }
  // 2 (Gemma: 3) layers x (q_norm, k_norm)
  EXPECT_EQ(norms, c.family == "qwen3" ? 4 : c.family == "gemma3" ? 6 : 0);
  EXPECT_EQ(biases, c.family == "qwen2" ? 6 : 0);  // 2 layers x (q, k, v)
  run_ranks(c.tp, [&](int) {
    auto mesh = init_device_mesh("cpu", {c.tp});
    const auto got = gradients(c.family, mesh);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, g] : want) {
      ASSERT_TRUE(got.at(name).defined()) << name;
      const double scale = g.abs().max().item<double>();
      EXPECT_GT(scale, 0) << name;
      EXPECT_LE((got.at(name) - g).abs().max().item<double>(), 1e-12 * std::max(scale, 1.0))
          << c.family << " tp=" << c.tp << " " << name;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FamilyGradients,
                         ::testing::Values(Case{"qwen3", 2}, Case{"qwen3", 4}, Case{"qwen2", 3},
                                           Case{"mistral", 3}, Case{"gemma3", 2},
                                           Case{"gemma3", 4}),
                         case_name);

// Every feature at once (decoupled head size, q/k/v and o biases as Llama's attention_bias gives,
// q/k norms, a sliding window on layer 0 only), from one seed: at TP 2 and 4 (KV heads
// replicated) the logits and every gradient equal one device's, and generation (whose Decoder adds
// wo's bias once after the all-reduce) gives one device's tokens, which equal greedy decoding by
// recomputing the whole forward.
DecoderConfig all_features() {
  DecoderConfig c;
  c.vocab_size = 64;
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_size = 12;
  c.ffn_hidden_dim = 48;
  c.max_seq_len = 32;
  c.qkv_bias = c.wo_bias = c.qk_norm = true;
  c.sliding_window = 3;
  c.sliding_layers = {true, false};
  return c;
}

Transformer all_features_model() {
  Transformer model(all_features());
  model->to(at::kDouble);
  model->init_weights(3);
  at::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (const auto& p : model->named_parameters()) {
    // Biases start at 0 and norms at 1, where a misplaced one would not show.
    if (p.key().ends_with(".bias")) p.value().normal_(0.0, 0.5, gen);
    if (p.key().ends_with("_norm.weight")) p.value().uniform_(0.5, 2.0, gen);
  }
  return model;
}

TEST(HfFamilies, AllFeaturesUnderTPEqualOneDevice) {
  const at::Tensor tokens = at::randint(64, {2, 12}, at::kLong);
  const at::Tensor targets = at::roll(tokens, -1, 1);
  Transformer whole = all_features_model();
  const at::Tensor want_logits = whole->forward(tokens);
  loss_and_backward(want_logits, targets);
  const std::vector<int64_t> prompt{5, 9, 2, 33, 7, 1};
  GenerateOptions options;
  options.max_new_tokens = 8;
  const auto want_tokens = generate(*whole, {prompt}, options).tokens[0];
  {
    at::NoGradGuard no_grad;
    std::vector<int64_t> seq = prompt;
    for (int i = 0; i < 8; ++i)
      seq.push_back(whole->forward(at::tensor(seq).unsqueeze(0))[0][-1].argmax().item<int64_t>());
    EXPECT_EQ(want_tokens, std::vector<int64_t>(seq.begin() + 6, seq.end()));
  }
  for (int tp : {2, 4}) {
    run_ranks(tp, [&](int) {
      auto mesh = init_device_mesh("cpu", {tp});
      Transformer model = all_features_model();
      apply_tensor_parallel(*model, mesh);
      const at::Tensor logits = model->forward(tokens);
      EXPECT_LE((full_tensor(logits) - want_logits).abs().max().item<double>(), 1e-12);
      loss_and_backward(logits, targets);
      reduce_partial_grads(*model);
      for (const auto& p : whole->named_parameters()) {
        const at::Tensor g = model->named_parameters()[p.key()].grad();
        EXPECT_LE(
            ((is_dtensor(g) ? full_tensor(g) : g) - p.value().grad()).abs().max().item<double>(),
            1e-12)
            << "tp=" << tp << " " << p.key();
      }
      EXPECT_EQ(generate(*model, {prompt}, options).tokens[0], want_tokens) << "tp=" << tp;
    });
  }
}

TEST(HfFamilies, ReadsEachConfig) {
  const auto qwen3 = read_hf_config(kModels + "qwen3");
  EXPECT_EQ(qwen3.architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(qwen3.config.head_dim(), 8);
  EXPECT_EQ(qwen3.config.dim, 48);
  EXPECT_TRUE(qwen3.config.qk_norm);
  EXPECT_FALSE(qwen3.config.qkv_bias);
  EXPECT_EQ(qwen3.config.window(0), 0);
  EXPECT_EQ(qwen3.config.rope_theta, 1000.0);  // rope_parameters (transformers 5)
  const auto qwen2 = read_hf_config(kModels + "qwen2");
  EXPECT_EQ(qwen2.architecture, "Qwen2ForCausalLM");
  EXPECT_TRUE(qwen2.config.qkv_bias);
  EXPECT_FALSE(qwen2.config.wo_bias);
  EXPECT_EQ(qwen2.config.window(0), 0);  // max_window_layers=1 (no layer_types: transformers 4)
  EXPECT_EQ(qwen2.config.window(1), 5);
  EXPECT_EQ(qwen2.config.rope_theta, 500.0);  // top-level rope_theta (transformers 4)
  const auto mistral = read_hf_config(kModels + "mistral");
  EXPECT_EQ(mistral.architecture, "MistralForCausalLM");
  EXPECT_EQ(mistral.config.window(0), 5);
  EXPECT_EQ(mistral.config.window(1), 5);
  const auto gemma = read_hf_config(kModels + "gemma3");
  EXPECT_EQ(gemma.architecture, "Gemma3ForCausalLM");
  const DecoderConfig& g = gemma.config;
  EXPECT_EQ(g.head_dim(), 16);
  EXPECT_TRUE(g.qk_norm && g.post_norms && g.scale_embeddings && g.tie_embeddings);
  EXPECT_EQ(g.norm_weight_offset, 1.0);
  EXPECT_EQ(g.activation, "gelu_tanh");
  EXPECT_EQ(g.attention_scale(), 1.0 / std::sqrt(24.0));  // query_pre_attn_scalar, not head_dim
  EXPECT_EQ(g.window(0), 5);
  EXPECT_EQ(g.window(1), 0);
  EXPECT_EQ(g.window(2), 5);
  EXPECT_EQ(g.rope_base(0), 100.0);  // rope_parameters.sliding_attention
  EXPECT_EQ(g.rope_base(1), 10000.0);
  EXPECT_EQ(g.rope_base(2), 100.0);
  EXPECT_EQ(g.num_parameters(),
            256 * 48 + 3 * (48 * 64 + 2 * 48 * 32 + 64 * 48 + 2 * 16 + 3 * 48 * 24 + 4 * 48) + 48);
}

// final_logit_softcapping (null in Gemma 3's own configs, 30 in Gemma 2's) caps the logits as
// cap * tanh(logits / cap): with 2.0 on the Gemma 3 fixture, whose logits reach about 3, the logits
// equal transformers' with the same setting, whole and vocab-sharded (TP 2, loss parallel).
TEST(HfFamilies, Gemma3FinalLogitSoftcapping) {
  const auto ref = reference("gemma3");
  dtensor::testing::FixtureCopy c(kModels, "gemma3");
  auto j = c.config();
  j["final_logit_softcapping"] = 2.0;
  c.set_config(j);
  EXPECT_EQ(read_hf_config(c.dir).config.final_logit_softcap, 2.0);
  for (int tp : {1, 2}) {
    run_ranks(tp, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {tp});
      for (const auto& [dtype, key, tolerance] :
           {std::tuple{at::kFloat, "logits_softcap", 1e-5},
            std::tuple{at::kDouble, "logits_softcap_f64", 1e-12}}) {
        HfModel hf = load_hf(c.dir, mesh, {.dtype = dtype});
        at::NoGradGuard no_grad;
        at::Tensor logits = hf.model->forward(ref.at("tokens"));
        if (is_dtensor(logits)) logits = full_tensor(logits);
        const at::Tensor& want = ref.at(key);
        EXPECT_LE(logits.abs().max().item<double>(), 2.0);
        const double error = (logits - want).abs().max().item<double>() / 2.0;
        EXPECT_LE(error, tolerance) << "tp=" << tp << " " << dtype;
        if (rank == 0)
          std::cout << "gemma3 softcap tp=" << tp << " " << dtype
                    << ": max |logits - HF| / cap = " << error << "\n";
      }
    });
  }
}

// The other plans place Gemma's post norms too: without sequence parallelism they run whole, with
// overlap_comm on the shards the overlapped wo/w2 reduce-scatter to; loss parallelism off gathers
// the logits. Each equals one device in float64.
TEST(HfFamilies, Gemma3UnderEveryPlanEqualsOneDevice) {
  const at::Tensor tokens = reference("gemma3").at("tokens");
  at::Tensor want;
  {
    at::NoGradGuard no_grad;
    want = load_hf(kModels + "gemma3", std::nullopt, {.dtype = at::kDouble}).model->forward(tokens);
  }
  for (const TensorParallelOptions& plan : {TensorParallelOptions{.sequence_parallel = false},
                                            TensorParallelOptions{.loss_parallel = false},
                                            TensorParallelOptions{.overlap_comm = true}}) {
    run_ranks(2, [&](int) {
      auto mesh = init_device_mesh("cpu", {2});
      HfModel hf = load_hf(kModels + "gemma3", mesh, {.dtype = at::kDouble, .tp = plan});
      at::NoGradGuard no_grad;
      at::Tensor logits = hf.model->forward(tokens);
      if (is_dtensor(logits)) logits = full_tensor(logits);
      EXPECT_LE((logits - want).abs().max().item<double>(), 1e-12)
          << "sp=" << plan.sequence_parallel << " lp=" << plan.loss_parallel
          << " overlap=" << plan.overlap_comm;
    });
  }
}

// Pipeline stages run the same blocks with each layer's own rotary table (local and global bases)
// and the scaled embedding on the first stage: two stages equal the whole model.
TEST(HfFamilies, Gemma3PipelineStagesEqualTheWholeModel) {
  HfModel hf = load_hf(kModels + "gemma3", std::nullopt, {.dtype = at::kDouble});
  const at::Tensor tokens = reference("gemma3").at("tokens");
  at::NoGradGuard no_grad;
  const at::Tensor want = hf.model->forward(tokens);
  Transformer first(*hf.model, 0, 2), last(*hf.model, 1, 2);
  EXPECT_EQ(first->end_layer(), last->first_layer());
  EXPECT_LE((last->forward(first->forward(tokens)) - want).abs().max().item<double>(), 1e-12);
}

// transformers 4 spells Gemma 3's rotary bases rope_theta and rope_local_base_freq and its
// sliding layers sliding_window_pattern (every pattern-th layer global): the same model.
TEST(HfFamilies, ReadsGemma3InTransformers4Spelling) {
  dtensor::testing::FixtureCopy c(kModels, "gemma3");
  auto j = c.config();
  j.erase("layer_types");
  j.erase("rope_parameters");
  j.erase("_sliding_window_pattern");
  j["sliding_window_pattern"] = 2;
  j["rope_theta"] = 10000.0;
  j["rope_local_base_freq"] = 100.0;
  j["rope_scaling"] = nullptr;
  c.set_config(j);
  EXPECT_EQ(read_hf_config(c.dir).config.to_json(),
            read_hf_config(kModels + "gemma3").config.to_json());
}

struct Copy : dtensor::testing::FixtureCopy {
  explicit Copy(const std::string& name) : FixtureCopy(kModels, name) {}
};

TEST(HfFamilies, RefusesWhatIsNotBuiltNamingFileKeyAndValue) {
  auto refused = [](const std::string& family, const std::function<void(nlohmann::json&)>& edit) {
    Copy c(family);
    auto j = c.config();
    edit(j);
    c.set_config(j);
    const std::string msg = message_of([&] { load_hf(c.dir); });
    EXPECT_CONTAINS(msg, c.dir + "/");
    return msg;
  };
  EXPECT_CONTAINS(
      refused("qwen3", [](auto& j) { j["num_experts"] = 8; }),
      "config.json': \"num_experts\": 8 asks for mixture-of-experts layers, which is not built");
  EXPECT_CONTAINS(refused("qwen3", [](auto& j) { j["layer_types"][1] = "linear_attention"; }),
                  "\"layer_types\" holds \"linear_attention\", which is not built");
  EXPECT_CONTAINS(
      refused("mistral", [](auto& j) { j["rope_parameters"]["rope_type"] = "dynamic"; }),
      "\"rope_parameters.rope_type\": rope type \"dynamic\" is not supported");
  EXPECT_CONTAINS(refused("mistral", [](auto& j) { j["architectures"] = {"Gemma2ForCausalLM"}; }),
                  "architecture Gemma2ForCausalLM is not supported; supported: LlamaForCausalLM");
  EXPECT_CONTAINS(refused("qwen2", [](auto& j) { j["hidden_act"] = "gelu"; }),
                  "\"hidden_act\": \"gelu\" is not supported");
  EXPECT_CONTAINS(refused("qwen2", [](auto& j) { j["query_pre_attn_scalar"] = 24; }),
                  "\"query_pre_attn_scalar\": 24 asks for a query scale other than");
  // Gemma reads final_logit_softcapping (Gemma3FinalLogitSoftcapping); the others do not.
  EXPECT_CONTAINS(refused("mistral", [](auto& j) { j["final_logit_softcapping"] = 30.0; }),
                  "\"final_logit_softcapping\": 30.0 asks for final logit soft-capping, which is "
                  "not built");
  EXPECT_CONTAINS(refused("gemma3", [](auto& j) { j["attn_logit_softcapping"] = 50.0; }),
                  "\"attn_logit_softcapping\": 50.0 asks for attention logit soft-capping");
  EXPECT_CONTAINS(refused("gemma3", [](auto& j) { j["use_bidirectional_attention"] = true; }),
                  "\"use_bidirectional_attention\": true asks for bidirectional attention");
  EXPECT_CONTAINS(refused("gemma3", [](auto& j) { j["hidden_activation"] = "gelu"; }),
                  "\"hidden_activation\": \"gelu\" is not supported");
  EXPECT_CONTAINS(
      refused("gemma3",
              [](auto& j) { j["rope_parameters"]["full_attention"]["rope_type"] = "linear"; }),
      "\"rope_parameters.full_attention.rope_type\": rope type \"linear\" is not supported");
  // A tensor whose shape disagrees with config.json: names the file and the tensor.
  const std::string msg = refused("qwen3", [](auto& j) { j["head_dim"] = 16; });
  EXPECT_CONTAINS(msg, "model.safetensors', tensor \"model.layers.0.self_attn.q_proj.weight\"");
  EXPECT_CONTAINS(msg, "shape [96, 48] disagrees with config.json, which gives [192, 48]");
  {
    Copy c("qwen2");
    fs::remove(c.dir + "/model.safetensors");
    EXPECT_CONTAINS(message_of([&] { load_hf(c.dir); }),
                    "has neither model.safetensors nor model.safetensors.index.json");
  }
}

// A bad checkpoint leaves a loaded model as it was: every tensor is read and checked first.
TEST(HfFamilies, NothingIsHalfLoaded) {
  HfModel hf = load_hf(kModels + "qwen3", std::nullopt, {.dtype = at::kDouble});
  std::map<std::string, at::Tensor> before;
  for (const auto& p : hf.model->named_parameters()) before[p.key()] = p.value().clone();
  // The Mistral fixture has the same hidden size and vocabulary but narrower heads.
  EXPECT_CONTAINS(message_of([&] { load_hf_weights(kModels + "mistral", *hf.model); }),
                  "tensor \"model.layers.0.self_attn.q_proj.weight\": shape [48, 48] disagrees");
  for (const auto& p : hf.model->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), before.at(p.key()))) << p.key();
}

// Each family from a checkpoint sharded over two files (model.safetensors.index.json) in
// bfloat16, as large checkpoints are published, and in float16, read at TP=2 (Qwen2: 3) in
// float32: every rank's parameters are its slices of the single float32 file's tensors rounded
// to that dtype.
TEST(HfFamilies, EachLoadsFromABfloat16OrFloat16IndexOfShardFiles) {
  for (const auto& [dtype, dtype_name] : std::vector<std::pair<at::ScalarType, std::string>>{
           {at::kBFloat16, "bfloat16"}, {at::kHalf, "float16"}})
    for (const auto& [name, tp] : std::vector<std::pair<std::string, int>>{
             {"qwen3", 2}, {"qwen2", 3}, {"mistral", 2}, {"gemma3", 2}}) {
      SCOPED_TRACE(name + " " + dtype_name);
      FixtureCopy copy(kModels, name);
      const auto original = safetensors::load_file(kModels + name + "/model.safetensors");
      std::map<std::string, at::Tensor> files[2];
      nlohmann::json weight_map = nlohmann::json::object();
      int64_t total = 0, i = 0;
      for (const auto& [key, value] : original) {
        const int f = static_cast<int>(i++ % 2);
        files[f][key] = value.to(dtype);
        weight_map[key] = "model-0000" + std::to_string(f + 1) + "-of-00002.safetensors";
        total += value.numel() * 2;
      }
      for (int f = 0; f < 2; ++f)
        safetensors::save_file(
            files[f], copy.dir + "/model-0000" + std::to_string(f + 1) + "-of-00002.safetensors");
      std::ofstream(copy.dir + "/model.safetensors.index.json") << nlohmann::json{
          {"metadata", {{"total_size", total}}},
          {"weight_map", weight_map}}.dump();
      fs::remove(copy.dir + "/model.safetensors");
      auto config = copy.config();
      config[config.contains("dtype") ? "dtype" : "torch_dtype"] = dtype_name;
      copy.set_config(config);
      run_ranks(tp, [&](int) {
        auto mesh = init_device_mesh("cpu", {tp});
        HfModel single = load_hf(kModels + name, mesh, {.dtype = at::kFloat});
        HfModel sharded = load_hf(copy.dir, mesh, {.dtype = at::kFloat});
        const auto want = single.model->named_parameters();
        const auto got = sharded.model->named_parameters();
        ASSERT_EQ(got.size(), want.size());
        for (const auto& p : want) {
          const at::Tensor w = is_dtensor(p.value()) ? local_tensor(p.value()) : p.value();
          const at::Tensor g = is_dtensor(got[p.key()]) ? local_tensor(got[p.key()]) : got[p.key()];
          EXPECT_TRUE(at::equal(g, w.to(dtype).to(at::kFloat))) << p.key();
        }
      });
    }
}

// Saved from TP=2 (Qwen2: 3), each family's directory holds the very tensors transformers wrote and
// a config.json naming the same family and configuration (transformers loads it:
// tests/fixtures/hf/check_saved.py with DTENSOR_KEEP_HF_SAVED).
TEST(HfFamilies, SaveFromTPWritesWhatWasLoaded) {
  for (const auto& [name, tp] : std::vector<std::pair<std::string, int>>{
           {"qwen3", 2}, {"qwen2", 3}, {"mistral", 2}, {"gemma3", 2}}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    const std::string out = tmp.file("saved");
    run_ranks(tp, [&](int) {
      auto mesh = init_device_mesh("cpu", {tp});
      HfModel hf = load_hf(kModels + name, mesh, {.dtype = at::kFloat});
      save_hf(out, *hf.model);
    });
    const auto original = safetensors::load_file(kModels + name + "/model.safetensors");
    safetensors::File saved(out + "/model.safetensors");
    ASSERT_EQ(saved.tensors().size(), original.size());
    for (const auto& [tensor, value] : original)
      EXPECT_TRUE(at::equal(saved.tensor(tensor), value)) << tensor;
    const auto back = read_hf_config(out), orig = read_hf_config(kModels + name);
    EXPECT_EQ(back.config.to_json(), orig.config.to_json());
    EXPECT_EQ(back.architecture, orig.architecture);
    if (const char* keep = std::getenv("DTENSOR_KEEP_HF_SAVED")) {
      fs::create_directories(keep);
      fs::copy(out, std::string(keep) + "/" + name,
               fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    }
  }
}

// ---- mixture-of-experts families ----
//
// tests/fixtures/hf/make_moe_fixtures.py: Qwen3-MoE (8 experts of width 16, top 2 renormalised,
// layer 1 dense by mlp_only_layers, q/k norms), Mixtral (4 experts, float32 routing weights),
// gpt-oss (4 experts with biases, router bias, clamped SwiGLU, sinks, q/k/v/o biases, sliding and
// full layers, YaRN) and gpt-oss with its experts in MXFP4. Each loads into the one decoder at
// TP 1, 2 and 4 (experts split like dense feed-forwards) and gives transformers' logits and
// greedy tokens.

const std::string kMoeModels = std::string(DTENSOR_HF_FIXTURES) + "/moe_models/";

auto moe_reference(const std::string& name) {
  return safetensors::load_file(kMoeModels + name + "/reference.safetensors");
}

std::vector<Case> moe_cases() {
  return {{"qwen3_moe", 1}, {"qwen3_moe", 2},     {"qwen3_moe", 4},    {"mixtral", 1},
          {"mixtral", 2},   {"mixtral", 4},       {"gpt_oss", 1},      {"gpt_oss", 2},
          {"gpt_oss", 4},   {"gpt_oss_mxfp4", 1}, {"gpt_oss_mxfp4", 2}};
}

std::vector<int64_t> row_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

class MoeFamilyMatchesHF : public ::testing::TestWithParam<Case> {};

// float32 logits within 1e-5 of HF's (relative to their largest), and greedy generation (with the
// cached decoder's experts) equal to generate()'s, token for token.
TEST_P(MoeFamilyMatchesHF, LogitsAndGreedyTokens) {
  const Case c = GetParam();
  const auto ref = moe_reference(c.family);
  run_ranks(c.tp, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {c.tp});
    HfModel hf = load_hf(kMoeModels + c.family, mesh, {.dtype = at::kFloat});
    ASSERT_TRUE(hf.config.has_moe());
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = hf.model->forward(ref.at("tokens"));
      if (is_dtensor(logits)) logits = full_tensor(logits);
    }
    const at::Tensor& want = ref.at("logits");
    const double scale = want.abs().max().item<double>();
    EXPECT_GT(scale, 0.5);
    const double error = (logits - want).abs().max().item<double>() / scale;
    EXPECT_LE(error, 1e-5) << c.family;
    if (rank == 0)
      std::cout << c.family << " tp=" << c.tp
                << " float32: max |logits - HF| / max |HF| = " << error << "\n";
    if (!ref.count("greedy")) return;  // MXFP4: logits only
    const at::Tensor tokens = ref.at("tokens"), greedy = ref.at("greedy");
    GenerateOptions options;
    options.max_new_tokens = greedy.size(1);
    for (int64_t b = 0; b < tokens.size(0); ++b)
      EXPECT_EQ(generate(*hf.model, {row_of(tokens[b])}, options).tokens[0], row_of(greedy[b]))
          << c.family << " prompt " << b;
  });
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MoeFamilyMatchesHF, ::testing::ValuesIn(moe_cases()), case_name);

// Loaded in bfloat16: HF's bfloat16 logits bit for bit at TP 1; at TP > 1 (sums over ranks
// rounded per rank) nearer them than HF's bfloat16 logits are to its float32 ones. (The MXFP4
// fixture has float32 references only.)
class MoeFamilyBfloat16 : public ::testing::TestWithParam<Case> {};

TEST_P(MoeFamilyBfloat16, LogitsEqualHF) {
  const Case c = GetParam();
  const auto ref = moe_reference(c.family);
  const at::Tensor want = ref.at("logits_bf16").to(at::kFloat);
  const double scale = want.abs().max().item<double>();
  const double bf16_vs_f32 = (want - ref.at("logits")).abs().max().item<double>() / scale;
  run_ranks(c.tp, [&](int) {
    auto mesh = init_device_mesh("cpu", {c.tp});
    HfModel hf = load_hf(kMoeModels + c.family, mesh, {.dtype = at::kBFloat16});
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = hf.model->forward(ref.at("tokens"));
      if (is_dtensor(logits)) logits = full_tensor(logits);
    }
    const double error = (logits.to(at::kFloat) - want).abs().max().item<double>() / scale;
    if (c.tp == 1)
      EXPECT_TRUE(at::equal(logits, ref.at("logits_bf16"))) << c.family << " error " << error;
    else
      EXPECT_LT(error, bf16_vs_f32) << c.family << " tp=" << c.tp;
  });
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MoeFamilyBfloat16,
                         ::testing::Values(Case{"qwen3_moe", 1}, Case{"qwen3_moe", 2},
                                           Case{"mixtral", 1}, Case{"mixtral", 4},
                                           Case{"gpt_oss", 1}, Case{"gpt_oss", 2}),
                         case_name);

// The training loss of HF's batch: cross-entropy plus router_aux_loss_coef times the
// load-balancing loss over the sparse layers, as transformers computes it with
// output_router_logits.
TEST(HfFamilies, MoeTrainingLossIncludesTheAuxiliaryLoss) {
  for (const std::string name : {"qwen3_moe", "mixtral", "gpt_oss"}) {
    const auto ref = moe_reference(name);
    HfModel hf = load_hf(kMoeModels + name, std::nullopt, {.dtype = at::kFloat});
    const at::Tensor logits = hf.model->forward(ref.at("train.tokens"));
    // HF shifts the labels itself: position t predicts label t + 1.
    const at::Tensor labels = ref.at("train.labels");
    const at::Tensor ce =
        at::cross_entropy_loss(logits.narrow(1, 0, logits.size(1) - 1).flatten(0, 1),
                               labels.narrow(1, 1, labels.size(1) - 1).flatten());
    const at::Tensor aux = hf.model->aux_loss();
    ASSERT_TRUE(aux.defined()) << name;
    EXPECT_NEAR(aux.item<double>(), ref.at("train.aux_loss").item<double>(), 1e-5) << name;
    const double coef = hf.config.moe->router_aux_loss_coef;
    EXPECT_NEAR((ce + coef * aux).item<double>(), ref.at("train.loss").item<double>(), 1e-5)
        << name;
  }
}

TEST(HfFamilies, ReadsEachMoeConfig) {
  const auto qwen = read_hf_config(kMoeModels + "qwen3_moe");
  EXPECT_EQ(qwen.architecture, "Qwen3MoeForCausalLM");
  ASSERT_TRUE(qwen.config.moe);
  EXPECT_EQ(qwen.config.moe->options.num_experts, 8);
  EXPECT_EQ(qwen.config.moe->expert_hidden_dim, 16);
  EXPECT_EQ(qwen.config.hidden_dim(), 48);  // the dense layer's
  EXPECT_TRUE(qwen.config.sparse(0));
  EXPECT_FALSE(qwen.config.sparse(1));  // mlp_only_layers
  const auto mixtral = read_hf_config(kMoeModels + "mixtral");
  EXPECT_EQ(mixtral.architecture, "MixtralForCausalLM");
  EXPECT_TRUE(mixtral.config.moe->options.float32_weights);
  const auto oss = read_hf_config(kMoeModels + "gpt_oss");
  EXPECT_EQ(oss.architecture, "GptOssForCausalLM");
  EXPECT_TRUE(oss.config.attention_sinks && oss.config.qkv_bias && oss.config.wo_bias);
  ASSERT_TRUE(oss.config.rope_yarn);
  EXPECT_EQ(oss.config.rope_yarn->factor, 4.0);
  EXPECT_EQ(oss.config.window(0), 4);
  EXPECT_EQ(oss.config.window(1), 0);
  EXPECT_EQ(oss.config.moe->options.scoring, RouterScoring::kTopKThenSoftmax);
  // num_parameters counts what the checkpoint holds.
  for (const std::string name : {"qwen3_moe", "mixtral", "gpt_oss"}) {
    int64_t stored = 0;
    for (const auto& [key, t] : safetensors::load_file(kMoeModels + name + "/model.safetensors"))
      stored += t.numel();
    EXPECT_EQ(read_hf_config(kMoeModels + name).config.num_parameters(), stored) << name;
  }
}

// Saved from TP 2 and 4: the very tensors transformers wrote (per expert, or gpt-oss's stacked
// layout with biases) and a config.json that reads back to the same configuration; the MXFP4
// checkpoint is written dequantised, in the model's dtype, and reloads to the same logits.
TEST(HfFamilies, MoeSaveFromTPWritesWhatWasLoaded) {
  for (const auto& [name, tp] : std::vector<std::pair<std::string, int>>{
           {"qwen3_moe", 2}, {"mixtral", 4}, {"gpt_oss", 2}, {"gpt_oss_mxfp4", 2}}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    const std::string out = tmp.file("saved");
    run_ranks(tp, [&](int) {
      auto mesh = init_device_mesh("cpu", {tp});
      HfModel hf = load_hf(kMoeModels + name, mesh, {.dtype = at::kFloat});
      save_hf(out, *hf.model);
    });
    const auto back = read_hf_config(out), orig = read_hf_config(kMoeModels + name);
    EXPECT_EQ(back.config.to_json(), orig.config.to_json());
    EXPECT_EQ(back.architecture, orig.architecture);
    safetensors::File saved(out + "/model.safetensors");
    if (name == "gpt_oss_mxfp4") {
      EXPECT_NE(saved.find("model.layers.0.mlp.experts.gate_up_proj"), nullptr);
      EXPECT_EQ(saved.find("model.layers.0.mlp.experts.gate_up_proj_blocks"), nullptr);
      const auto ref = moe_reference(name);
      HfModel reloaded = load_hf(out, std::nullopt, {.dtype = at::kFloat});
      at::NoGradGuard no_grad;
      const at::Tensor logits = reloaded.model->forward(ref.at("tokens"));
      EXPECT_LE((logits - ref.at("logits")).abs().max().item<double>() /
                    ref.at("logits").abs().max().item<double>(),
                1e-5);
    } else {
      const auto original = safetensors::load_file(kMoeModels + name + "/model.safetensors");
      ASSERT_EQ(saved.tensors().size(), original.size());
      for (const auto& [tensor, value] : original)
        EXPECT_TRUE(at::equal(saved.tensor(tensor), value)) << tensor;
    }
    if (const char* keep = std::getenv("DTENSOR_KEEP_HF_SAVED")) {
      fs::create_directories(keep);
      fs::copy(out, std::string(keep) + "/" + name,
               fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    }
  }
}

// Bad mixture-of-experts input: one line naming the file, the key or tensor and the value, and a
// loaded model left as it was (every tensor is read and checked before the first changes).
TEST(HfFamilies, MoeBadInputIsRefusedNamingFileKeyAndValueNothingHalfLoaded) {
  struct MoeCopy : FixtureCopy {
    explicit MoeCopy(const std::string& name) : FixtureCopy(kMoeModels, name) {}
    // model.safetensors with `edit` applied to its tensors.
    void edit_tensors(const std::function<void(std::map<std::string, at::Tensor>&)>& edit) const {
      auto tensors = safetensors::load_file(dir + "/model.safetensors");
      edit(tensors);
      safetensors::save_file(tensors, dir + "/model.safetensors");
    }
  };
  HfModel loaded = load_hf(kMoeModels + "qwen3_moe", std::nullopt, {.dtype = at::kFloat});
  std::map<std::string, at::Tensor> before;
  for (const auto& p : loaded.model->named_parameters()) before[p.key()] = p.value().clone();
  auto refused = [&](const MoeCopy& c) {
    const std::string msg = message_of([&] { load_hf(c.dir); });
    EXPECT_CONTAINS(msg, c.dir);
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    if (c.config()["architectures"][0] == "Qwen3MoeForCausalLM")
      message_of([&] { load_hf_weights(c.dir, *loaded.model); });
    return msg;
  };
  const std::string expert = "model.layers.2.mlp.experts.5.down_proj.weight";
  {
    MoeCopy c("qwen3_moe");
    c.edit_tensors([&](auto& t) { t.erase(expert); });
    EXPECT_CONTAINS(refused(c), "tensor \"" + expert + "\" is missing from model.safetensors");
  }
  {
    MoeCopy c("qwen3_moe");
    c.edit_tensors([&](auto& t) { t[expert] = at::zeros({32, 8}); });
    const std::string msg = refused(c);
    EXPECT_CONTAINS(msg, "model.safetensors', tensor \"" + expert + "\": shape [32, 8]");
    EXPECT_CONTAINS(msg, "disagrees with config.json, which gives [32, 16]");
  }
  {
    MoeCopy c("qwen3_moe");
    auto j = c.config();
    j["num_experts_per_tok"] = 9;
    c.set_config(j);
    EXPECT_CONTAINS(refused(c), "config.json': \"num_experts_per_tok\": 9 must be in [1, ");
  }
  {
    MoeCopy c("qwen3_moe");
    auto j = c.config();
    j["scoring_func"] = "sigmoid";
    c.set_config(j);
    EXPECT_CONTAINS(refused(c), "\"scoring_func\": \"sigmoid\" is a router type that is not built");
  }
  {
    MoeCopy c("gpt_oss_mxfp4");
    const std::string scales = "model.layers.1.mlp.experts.down_proj_scales";
    c.edit_tensors([&](auto& t) { t[scales] = t.at(scales).narrow(2, 0, 0).contiguous(); });
    const std::string msg = refused(c);
    EXPECT_CONTAINS(msg, "tensor \"" + scales + "\": MXFP4 scales [4, 32, 0] do not match blocks");
  }
  for (const auto& p : loaded.model->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), before.at(p.key()))) << p.key();
}

}  // namespace
