// Generation with a KV cache: cached decoding equals recomputing the whole forward at every step
// (float64, logits to 1e-12), batches of different prompt lengths equal their one-prompt runs,
// TP=2, 3 and 4 (uneven vocab, replicated KV heads) give the single-device tokens greedy and
// sampled, a decode step issues exactly 2 all-reduces per layer + 1 for the embedding + 1
// all-gather, and the cache holds the bytes its formula says.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/models/generate.h"
#include "dtensor/models/transformer.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

using Tokens = std::vector<int64_t>;

Transformer make_model(const DecoderConfig& config, uint64_t seed = 5) {
  Transformer model(config);
  model->to(at::kDouble);
  model->init_weights(seed);
  return model;
}

// Divisible by TP 1-4 in heads and FFN; 2 KV heads (replicated at TP 3 and 4); a vocabulary
// that splits unevenly at TP 3 (84, 84, 82) and 4 (63, 63, 63, 61).
DecoderConfig tp_config() {
  DecoderConfig c;
  c.vocab_size = 250;
  c.dim = 48;
  c.n_layers = 2;
  c.n_heads = 12;
  c.n_kv_heads = 2;
  c.ffn_hidden_dim = 96;
  c.max_seq_len = 32;
  return c;
}

struct Reference {
  Tokens tokens;
  std::vector<at::Tensor> logits;  // (V) per generated token
};

// Greedy decoding by running the plain model on the whole sequence at every step.
Reference recompute_greedy(Transformer& model, const Tokens& prompt, int64_t n) {
  at::NoGradGuard no_grad;
  Reference r;
  Tokens seq = prompt;
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor logits = model->forward(at::tensor(seq, at::kLong).unsqueeze(0))[0][-1];
    r.logits.push_back(logits);
    r.tokens.push_back(logits.argmax().item<int64_t>());
    seq.push_back(r.tokens.back());
  }
  return r;
}

struct Generated {
  GenerateResult result;
  std::vector<at::Tensor> logits;  // (B, V) per forward
};

Generated run_generate(const TransformerImpl& model, const std::vector<Tokens>& prompts,
                       GenerateOptions options) {
  Generated run;
  options.on_logits = [&](const at::Tensor& l) { run.logits.push_back(l.clone()); };
  run.result = generate(model, prompts, options);
  return run;
}

GenerateOptions greedy(int64_t n) {
  GenerateOptions o;
  o.max_new_tokens = n;
  return o;
}

GenerateOptions sampled(int64_t n, uint64_t seed) {
  GenerateOptions o;
  o.max_new_tokens = n;
  o.temperature = 0.9;
  o.top_k = 40;
  o.top_p = 0.95;
  o.seed = seed;
  return o;
}

// Every generated token and logit row b of `run` equals `ref`.
void expect_matches(const Generated& run, int64_t b, const Reference& ref) {
  ASSERT_EQ(run.result.tokens.at(b), ref.tokens);
  for (size_t i = 0; i < ref.logits.size(); ++i)
    EXPECT_TENSOR_CLOSE(run.logits.at(i)[b], ref.logits[i], 1e-12, 1e-12) << "step " << i;
}

const std::vector<Tokens> kPrompts = {{5, 17, 200, 3, 99, 42}, {7}, {120, 1, 2, 249}};

}  // namespace

TEST(Generate, CachedGreedyEqualsRecomputingWithoutCache) {
  auto model = make_model(DecoderConfig::preset("tiny"));
  const Tokens prompt = {10, 20, 30, 40, 50};
  const Generated run = run_generate(*model, {prompt}, greedy(12));
  expect_matches(run, 0, recompute_greedy(model, prompt, 12));
  EXPECT_EQ(run.result.prompt_tokens, 5);
  EXPECT_EQ(run.result.new_tokens, 12);
  EXPECT_EQ(run.result.decode_steps, 11);
}

TEST(Generate, BatchOfDifferentLengthsEqualsOnePromptRuns) {
  auto model = make_model(tp_config());
  const Generated batch = run_generate(*model, kPrompts, greedy(10));
  for (size_t b = 0; b < kPrompts.size(); ++b) {
    const Generated alone = run_generate(*model, {kPrompts[b]}, greedy(10));
    EXPECT_EQ(batch.result.tokens[b], alone.result.tokens[0]) << "row " << b;
    expect_matches(batch, static_cast<int64_t>(b), recompute_greedy(model, kPrompts[b], 10));
  }
}

TEST(Generate, SamplingIsSeededAndTopKOneIsGreedy) {
  auto model = make_model(tp_config());
  const auto a = generate(*model, kPrompts, sampled(12, 1)).tokens;
  EXPECT_EQ(a, generate(*model, kPrompts, sampled(12, 1)).tokens);
  EXPECT_NE(a, generate(*model, kPrompts, sampled(12, 2)).tokens);
  const auto greedy_tokens = generate(*model, kPrompts, greedy(12)).tokens;
  EXPECT_NE(a, greedy_tokens);
  auto top1 = sampled(12, 3);
  top1.top_k = 1;
  EXPECT_EQ(generate(*model, kPrompts, top1).tokens, greedy_tokens);
  auto nucleus = sampled(12, 3);
  nucleus.top_k = 0;
  nucleus.top_p = 1e-9;  // only the most likely token reaches it
  EXPECT_EQ(generate(*model, kPrompts, nucleus).tokens, greedy_tokens);
}

TEST(Generate, SamplingFollowsTheDistribution) {
  // Two tokens with probabilities 0.75 and 0.25 (logits log 3, 0), 4000 draws.
  const at::Tensor logits = at::tensor({std::log(3.0), 0.0, -1e9}, at::kDouble).unsqueeze(0);
  SamplingOptions o;
  o.temperature = 1;
  o.seed = 9;
  int64_t first = 0;
  for (int64_t step = 0; step < 4000; ++step)
    first += sample_next_tokens(logits, o, step).item<int64_t>() == 0;
  EXPECT_NEAR(static_cast<double>(first) / 4000, 0.75, 0.03);
  o.top_p = 0.7;  // the first token alone reaches 0.7
  for (int64_t step = 0; step < 50; ++step)
    EXPECT_EQ(sample_next_tokens(logits, o, step).item<int64_t>(), 0);
}

TEST(Generate, StopTokensAndMaxNewTokens) {
  auto model = make_model(tp_config());
  const auto free = generate(*model, kPrompts, greedy(10)).tokens;
  for (const auto& row : free) ASSERT_EQ(row.size(), 10u);
  // Stop row 0 at its 4th token; rows that never emit it run to max_new_tokens.
  auto options = greedy(10);
  options.stop_tokens = {free[0][3]};
  std::map<int64_t, Tokens> streamed;
  options.on_token = [&](int64_t row, int64_t token) { streamed[row].push_back(token); };
  const auto stopped = generate(*model, kPrompts, options).tokens;
  for (size_t b = 0; b < free.size(); ++b) {
    auto at = std::find(free[b].begin(), free[b].end(), free[0][3]);
    const Tokens expected(free[b].begin(), at == free[b].end() ? at : at + 1);
    EXPECT_EQ(stopped[b], expected) << "row " << b;
    EXPECT_EQ(streamed[static_cast<int64_t>(b)], expected) << "row " << b;
  }
  EXPECT_EQ(stopped[0].size(), 4u);
  EXPECT_TRUE(generate(*model, kPrompts, greedy(0)).tokens[0].empty());
}

TEST(Generate, RefusesWhatDoesNotFit) {
  auto model = make_model(tp_config());  // max_seq_len 32
  EXPECT_CONTAINS(message_of([&] { generate(*model, {Tokens(30, 1)}, greedy(4)); }),
                  "exceeds max_seq_len=32");
  EXPECT_CONTAINS(message_of([&] {
                    generate(*model, {Tokens{1, 250}}, greedy(4));
                  }),
                  "token 250 outside the vocabulary [0, 250)");
  EXPECT_CONTAINS(message_of([&] { generate(*model, {Tokens{}}, greedy(4)); }),
                  "prompt 0 is empty");
}

TEST(Generate, CacheBytesFollowTheFormulaWithoutTP) {
  auto model = make_model(DecoderConfig::preset("tiny"));  // 2 layers, 2 KV heads of 8
  KVCache cache(*model, 3, 20);
  EXPECT_EQ(cache.bytes(), 2 * 2 * 3 * 20 * 2 * 8 * 8);
}

// Greedy and sampled tokens, logits to 1e-12, collective counts of a decode step and cache
// bytes at each TP degree against the single-device model built from the same seed.
void check_tp(int tp, TensorParallelOptions plan, bool tied) {
  run_ranks(tp, [&](int rank) {
    auto config = tp_config();
    config.tie_embeddings = tied;
    auto reference = make_model(config);
    auto model = make_model(config);
    apply_tensor_parallel(*model, init_device_mesh("cpu", {tp}), plan);

    const Generated run = run_generate(*model, kPrompts, greedy(8));
    for (size_t b = 0; b < kPrompts.size(); ++b)
      expect_matches(run, static_cast<int64_t>(b), recompute_greedy(reference, kPrompts[b], 8));
    for (uint64_t seed : {1, 2})
      EXPECT_EQ(generate(*model, kPrompts, sampled(8, seed)).tokens,
                generate(*reference, kPrompts, sampled(8, seed)).tokens)
          << "seed " << seed;

    // Local KV heads per rank: 12 query heads use KV head 0 (0-5) or 1 (6-11).
    const std::map<int, std::vector<int64_t>> local_kv = {
        {1, {2}}, {2, {1, 1}}, {3, {1, 2, 1}}, {4, {1, 1, 1, 1}}};
    KVCache cache(*model, 3, 20);
    EXPECT_EQ(cache.bytes(), 2 * config.n_layers * 3 * 20 * local_kv.at(tp).at(rank) * 4 * 8);

    CachedDecoder decoder(*model);
    decoder.forward(at::tensor({1, 2, 3, 4, 5, 6}, at::kLong).view({3, 2}), cache);
    CommDebugMode comm;
    decoder.forward(at::tensor({7, 8, 9}, at::kLong).view({3, 1}), cache);
    comm.exit();
    auto counts = comm.get_comm_counts();
    // One rank: no collective at all.
    EXPECT_EQ(counts[CommType::all_reduce], tp > 1 ? 2 * config.n_layers + 1 : 0);
    EXPECT_EQ(counts[CommType::all_gather_into_tensor], tp > 1 ? 1 : 0);
    EXPECT_EQ(comm.get_total_counts(), tp > 1 ? 2 * config.n_layers + 2 : 0);
  });
}

TEST(GenerateTP, OneRankMesh) { check_tp(1, {}, false); }
TEST(GenerateTP, TwoRanksShardedKV) { check_tp(2, {}, false); }
TEST(GenerateTP, TwoRanksMegatronPlanTiedEmbeddings) {
  check_tp(2, {.sequence_parallel = false, .loss_parallel = false}, true);
}
TEST(GenerateTP, ThreeRanksUnevenVocabReplicatedKV) { check_tp(3, {}, false); }
TEST(GenerateTP, FourRanksReplicatedKV) { check_tp(4, {}, false); }
