// The Llama model on one device: its forward and gradients equal an independent functional
// implementation (complex rotary embeddings, explicit causal softmax attention, repeat_interleave
// GQA), the initialisation depends on the seed alone, configs round-trip through JSON, tied
// weights are listed once, and TP degrees are validated with the valid ones named.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <map>
#include <string>

#include "dtensor/models/transformer.h"
#include "support/distributed.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

using Params = std::map<std::string, at::Tensor>;

Params params_of(const torch::nn::Module& m) {
  Params out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * w;
}

// Rotary embeddings as Llama writes them: consecutive pairs as complex numbers times e^{i p f}.
at::Tensor rotary_complex(const at::Tensor& x, const DecoderConfig& c) {
  const int64_t S = x.size(1), hd = c.head_dim();
  auto freqs = at::pow(c.rope_theta, -at::arange(0, hd, 2, at::kDouble) / static_cast<double>(hd));
  auto angles = at::outer(at::arange(S, at::kDouble), freqs);
  auto cis = at::polar(at::ones_like(angles), angles).view({1, S, 1, hd / 2});
  auto xc = at::view_as_complex(x.to(at::kDouble).reshape({x.size(0), S, x.size(2), hd / 2, 2}));
  return at::view_as_real(xc * cis).flatten(3).to(x.scalar_type());
}

// The Llama forward written out from the parameters alone.
at::Tensor reference_forward(const DecoderConfig& c, Params P, const at::Tensor& tokens) {
  const int64_t B = tokens.size(0), S = tokens.size(1), hd = c.head_dim();
  const int64_t n_rep = c.n_heads / c.kv_heads();
  auto h = P.at("tok_embeddings.weight").index_select(0, tokens.flatten()).view({B, S, c.dim});
  auto mask = at::full({S, S}, -std::numeric_limits<double>::infinity(), h.options()).triu(1);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    auto xn = rms_norm(h, P.at(p + "attention_norm.weight"), c.norm_eps);
    auto q = at::matmul(xn, P.at(p + "attention.wq.weight").t()).view({B, S, c.n_heads, hd});
    auto k = at::matmul(xn, P.at(p + "attention.wk.weight").t()).view({B, S, c.kv_heads(), hd});
    auto v = at::matmul(xn, P.at(p + "attention.wv.weight").t()).view({B, S, c.kv_heads(), hd});
    q = rotary_complex(q, c).transpose(1, 2);
    k = rotary_complex(k, c).repeat_interleave(n_rep, 2).transpose(1, 2);
    v = v.repeat_interleave(n_rep, 2).transpose(1, 2);
    auto scores = at::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(hd)) + mask;
    auto attn = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({B, S, -1});
    h = h + at::matmul(attn, P.at(p + "attention.wo.weight").t());
    auto hn = rms_norm(h, P.at(p + "ffn_norm.weight"), c.norm_eps);
    auto gate = at::silu(at::matmul(hn, P.at(p + "feed_forward.w1.weight").t()));
    auto up = at::matmul(hn, P.at(p + "feed_forward.w3.weight").t());
    h = h + at::matmul(gate * up, P.at(p + "feed_forward.w2.weight").t());
  }
  const auto& head = c.tie_embeddings ? P.at("tok_embeddings.weight") : P.at("output.weight");
  return at::matmul(rms_norm(h, P.at("norm.weight"), c.norm_eps), head.t());
}

DecoderConfig tiny(int64_t n_kv_heads = 2, bool tie = false) {
  auto c = DecoderConfig::preset("tiny");
  c.vocab_size = 48;
  c.n_kv_heads = n_kv_heads;
  c.tie_embeddings = tie;
  return c;
}

}  // namespace

TEST(DecoderConfig, PresetsValidateAndCountTheirParameters) {
  for (const auto& name : DecoderConfig::preset_names()) {
    SCOPED_TRACE(name);
    auto c = DecoderConfig::preset(name);
    EXPECT_NO_THROW(c.validate());
    EXPECT_EQ(c.hidden_dim() % c.multiple_of, 0);
    if (name == "tiny") {
      EXPECT_EQ(c.dim, 32);
      EXPECT_EQ(c.n_heads, 4);
      EXPECT_EQ(c.kv_heads(), 2);
      // num_parameters() agrees with the module's parameters.
      Transformer m(c);
      int64_t n = 0;
      for (const auto& p : m->parameters()) n += p.numel();
      EXPECT_EQ(n, c.num_parameters());
    }
    if (name == "demo") {
      EXPECT_GT(c.num_parameters(), 2'000'000);
      EXPECT_LT(c.num_parameters(), 6'000'000);
    }
    if (name == "bench") {
      EXPECT_GT(c.num_parameters(), 20'000'000);
      EXPECT_LT(c.num_parameters(), 35'000'000);
    }
  }
  EXPECT_THROW(DecoderConfig::preset("huge"), c10::Error);
}

TEST(DecoderConfig, FfnHiddenSizeFollowsLlamasRule) {
  DecoderConfig c;
  c.dim = 4096;
  c.multiple_of = 256;
  c.ffn_dim_multiplier = 1.3;
  EXPECT_EQ(c.hidden_dim(), 14336);  // Llama 3 8B
  c.ffn_dim_multiplier.reset();
  EXPECT_EQ(c.hidden_dim(), 11008);  // Llama 2 7B
  c.ffn_hidden_dim = 100;
  EXPECT_EQ(c.hidden_dim(), 100);
}

// Gemma's fields (hf_families.cpp sets them from a Gemma3ForCausalLM config) survive JSON.
TEST(DecoderConfig, GemmaFieldsRoundTripJson) {
  DecoderConfig c = DecoderConfig::preset("tiny");
  c.rope_local_theta = 10000;
  c.query_pre_attn_scalar = 24;
  c.norm_weight_offset = 1;
  c.post_norms = c.scale_embeddings = c.qk_norm = true;
  c.activation = "gelu_tanh";
  c.final_logit_softcap = 30;
  c.sliding_window = 4;
  c.sliding_layers = {true, false};
  const DecoderConfig back = DecoderConfig::from_json(c.to_json());
  EXPECT_EQ(back.to_json(), c.to_json());
  EXPECT_EQ(back.rope_base(0), 10000.0);
  EXPECT_EQ(back.rope_base(1), c.rope_theta);
  EXPECT_EQ(back.attention_scale(), 1.0 / std::sqrt(24.0));
  EXPECT_EQ(back.activation, "gelu_tanh");
  EXPECT_EQ(back.final_logit_softcap, 30.0);
  // Two norms more per block than Llama's.
  DecoderConfig plain = c;
  plain.post_norms = false;
  EXPECT_EQ(c.num_parameters() - plain.num_parameters(), 2 * c.n_layers * c.dim);
  c.activation = "relu";
  EXPECT_THROW(c.validate(), c10::Error);
}

TEST(DecoderConfig, JsonRoundTripsAndRejectsUnknownKeys) {
  auto c = DecoderConfig::preset("demo");
  c.tie_embeddings = true;
  c.ffn_dim_multiplier = 1.5;
  c.norm_eps = 1e-6;
  c.rope_theta = 500000;
  auto back = DecoderConfig::from_json(c.to_json());
  EXPECT_EQ(back.to_json(), c.to_json());
  EXPECT_EQ(back.dim, c.dim);
  EXPECT_EQ(back.hidden_dim(), c.hidden_dim());
  EXPECT_TRUE(back.tie_embeddings);
  EXPECT_EQ(*back.ffn_dim_multiplier, 1.5);
  EXPECT_EQ(back.norm_eps, 1e-6);

  auto partial = DecoderConfig::from_json(R"({"dim": 64, "n_heads": 8, "n_kv_heads": null})");
  EXPECT_EQ(partial.dim, 64);
  EXPECT_EQ(partial.kv_heads(), 8);
  EXPECT_EQ(partial.vocab_size, DecoderConfig().vocab_size);

  auto error = [](const std::string& json) {
    try {
      DecoderConfig::from_json(json);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(error(R"({"dimm": 64})").find("unknown key 'dimm'"), std::string::npos);
  EXPECT_NE(error(R"({"dim": 64.5})").find("'dim' must be an integer"), std::string::npos);
  EXPECT_NE(error(R"({"dim": 30, "n_heads": 4})").find("not divisible by n_heads"),
            std::string::npos);
  EXPECT_NE(error(R"({"dim": 32)").find("unexpected end"), std::string::npos);
}

TEST(DecoderConfig, TpDegreesThatSplitHeadsAndFfnAreListed) {
  DecoderConfig c;
  c.dim = 48;
  c.n_heads = 6;
  c.n_kv_heads = 2;
  c.ffn_hidden_dim = 192;
  EXPECT_EQ(c.valid_tp_degrees(), (std::vector<int64_t>{1, 2, 3, 6}));
  EXPECT_NO_THROW(c.validate_tp(3));  // KV heads (2) need not divide
  try {
    c.validate_tp(4);
    ADD_FAILURE() << "tp=4 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("n_heads=6 is not divisible by tp=4; valid tp degrees: 1, 2, 3, 6"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  c.ffn_hidden_dim = 200;  // 200 = 2^3 * 5^2
  EXPECT_EQ(c.valid_tp_degrees(), (std::vector<int64_t>{1, 2}));
  try {
    c.validate_tp(3);
    ADD_FAILURE() << "tp=3 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("FFN hidden size 200 is not divisible by tp=3; valid tp degrees: 1, 2"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(Llama, ForwardAndGradientsMatchAFunctionalReference) {
  at::manual_seed(0);
  for (const auto& c : {tiny(2), tiny(4), tiny(1), tiny(2, /*tie=*/true)}) {
    SCOPED_TRACE(c.to_json());
    Transformer model(c);
    model->to(at::kDouble);
    model->init_weights(7);
    auto tokens = at::randint(c.vocab_size, {2, 9}, at::kLong);
    auto targets = at::randint(c.vocab_size, {2, 9}, at::kLong);

    auto logits = model->forward(tokens);
    ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 9, c.vocab_size}));
    auto loss = token_cross_entropy(logits, targets);
    loss.backward();

    Params ref_params;
    for (const auto& [name, p] : params_of(*model))
      ref_params[name] = p.detach().clone().requires_grad_(true);
    auto ref_logits = reference_forward(c, ref_params, tokens);
    auto ref_loss = torch::nn::functional::cross_entropy(ref_logits.view({-1, c.vocab_size}),
                                                         targets.flatten());
    ref_loss.backward();
    EXPECT_TENSOR_CLOSE(logits.detach(), ref_logits.detach(), 1e-10, 1e-12);
    EXPECT_TENSOR_CLOSE(loss.detach(), ref_loss.detach(), 1e-10, 1e-12);
    for (const auto& [name, p] : params_of(*model)) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_TENSOR_CLOSE(p.grad(), ref_params.at(name).grad(), 1e-9, 1e-12);
    }
  }
}

TEST(Llama, InitialisationDependsOnlyOnTheSeed) {
  auto c = tiny(2);
  Transformer a(c), b(c), other(c);
  a->init_weights(3);
  // Draw from the global generator in between: init must not depend on it.
  at::randn({100});
  b->init_weights(3);
  other->init_weights(4);
  auto pa = params_of(*a), pb = params_of(*b), po = params_of(*other);
  for (const auto& [name, p] : pa) {
    SCOPED_TRACE(name);
    EXPECT_TENSOR_EQ(p, pb.at(name));
    if (name.find("norm") == std::string::npos) {
      EXPECT_FALSE(p.equal(po.at(name)));
    }
  }
  // torchtitan's scales: embeddings N(0, 1), projections 0.02, norms ones.
  EXPECT_NEAR(pa.at("tok_embeddings.weight").std().item<double>(), 1.0, 0.1);
  EXPECT_NEAR(pa.at("layers.0.attention.wq.weight").std().item<double>(), 0.02, 0.003);
  EXPECT_NEAR(pa.at("layers.1.attention.wo.weight").std().item<double>(), 0.02 / 2, 0.002);
  EXPECT_TENSOR_EQ(pa.at("norm.weight"), at::ones({c.dim}));
  const double head_std = 1.0 / std::sqrt(static_cast<double>(c.dim));
  EXPECT_LE(pa.at("output.weight").abs().max().item<double>(), 3 * head_std + 1e-7);
}

TEST(Llama, TiedEmbeddingIsOneParameterListedOnce) {
  Transformer m(tiny(2, /*tie=*/true));
  auto names = params_of(*m);
  EXPECT_EQ(names.count("output.weight"), 0u);
  EXPECT_EQ(names.count("tok_embeddings.weight"), 1u);
  EXPECT_TRUE(m->output->weight.is_same(m->tok_embeddings->weight));
  // Both uses reach the one gradient, and an optimizer steps it once.
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(0.1));
  auto before = m->tok_embeddings->weight.detach().clone();
  auto tokens = at::randint(48, {1, 4}, at::kLong);
  loss_and_backward(m->forward(tokens), tokens);
  opt.step();
  EXPECT_TRUE(m->output->weight.is_same(m->tok_embeddings->weight));
  EXPECT_FALSE(m->tok_embeddings->weight.equal(before));
  EXPECT_EQ(m->tok_embeddings->weight.size(0), 48);
}

TEST(Llama, LossHelpersAreMeanTokenCrossEntropy) {
  auto logits = at::randn({2, 5, 7}, at::kDouble).requires_grad_(true);
  auto targets = at::randint(7, {2, 5}, at::kLong);
  auto ref = at::cross_entropy_loss(logits.view({10, 7}), targets.view({10}));
  auto loss = token_cross_entropy(logits, targets);
  EXPECT_TENSOR_CLOSE(loss.detach(), ref.detach(), 1e-12, 1e-12);
  auto ref_grad = torch::autograd::grad({ref}, {logits})[0];
  auto value = loss_and_backward(logits, targets);
  EXPECT_FALSE(value.requires_grad());
  EXPECT_TENSOR_CLOSE(logits.grad(), ref_grad, 1e-12, 1e-12);
  EXPECT_THROW(token_cross_entropy(logits.view({10, 7}), targets), c10::Error);
}

TEST(Llama, RejectsSequencesLongerThanTheRotaryTable) {
  auto c = tiny(2);
  c.max_seq_len = 8;
  Transformer m(c);
  EXPECT_NO_THROW(m->forward(at::zeros({1, 8}, at::kLong)));
  EXPECT_THROW(m->forward(at::zeros({1, 9}, at::kLong)), c10::Error);
}
