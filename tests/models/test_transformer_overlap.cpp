// The Llama plan with overlap_comm: at TP 2 and 4, float32 and float64, with and without loss
// parallelism and for several piece counts, three AdamW steps give bitwise the same loss, every
// gradient and every parameter as the same plan without overlap (and match one device); a
// training step issues exactly the stated collectives; what the option cannot do is refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/models/transformer.h"
#include "dtensor/tp/overlap.h"
#include "support/comm_counts.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

DecoderConfig tiny(int64_t n_kv_heads) {
  auto c = DecoderConfig::preset("tiny");
  c.vocab_size = 64;
  c.n_kv_heads = n_kv_heads;
  return c;
}

DecoderConfig tied(DecoderConfig c) {
  c.tie_embeddings = true;
  return c;
}

struct Case {
  DecoderConfig config;
  bool loss_parallel = true;
  at::ScalarType dtype = at::kDouble;
  int64_t seqlen = 8;
  int64_t chunks = 2;
};

Transformer build(const Case& c, const DeviceMesh* mesh, bool overlap) {
  Transformer m(c.config);
  m->to(c.dtype);
  m->init_weights(5);
  if (mesh) {
    apply_tensor_parallel(*m, *mesh,
                          {.sequence_parallel = true,
                           .loss_parallel = c.loss_parallel,
                           .overlap_comm = overlap,
                           .overlap_chunks = c.chunks});
  }
  return m;
}

// Bitwise: the same placements and the same local shard on this rank.
::testing::AssertionResult identical(const at::Tensor& a, const at::Tensor& b) {
  if (is_dtensor(a) != is_dtensor(b)) return ::testing::AssertionFailure() << "DTensor vs plain";
  if (is_dtensor(a) && spec_of(a).placements() != spec_of(b).placements())
    return ::testing::AssertionFailure() << spec_of(a).str() << " vs " << spec_of(b).str();
  const at::Tensor la = is_dtensor(a) ? local_tensor(a) : a;
  const at::Tensor lb = is_dtensor(b) ? local_tensor(b) : b;
  if (la.sizes() == lb.sizes() && at::equal(la, lb)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "differ: max |a - b| = "
         << (la.sizes() == lb.sizes() ? (la - lb).abs().max().item<double>() : -1.0);
}

void expect_bitwise_training(const DeviceMesh& mesh, const Case& c) {
  SCOPED_TRACE(c10::str("tp=", mesh.size(), " ", c10::toString(c.dtype), " seqlen=", c.seqlen,
                        " chunks=", c.chunks, " loss_parallel=", c.loss_parallel,
                        " n_kv_heads=", c.config.kv_heads()));
  Transformer ref = build(c, nullptr, false), off = build(c, &mesh, false),
              on = build(c, &mesh, true);
  const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW ref_opt(ref->parameters(), opt), off_opt(off->parameters(), opt),
      on_opt(on->parameters(), opt);
  const auto ref_p = params_of(*ref), off_p = params_of(*off), on_p = params_of(*on);
  ASSERT_EQ(off_p.size(), on_p.size());
  const double tol = c.dtype == at::kDouble ? 1e-9 : 1e-5;
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    auto tokens = at::randint(c.config.vocab_size, {2, c.seqlen}, at::kLong);
    auto targets = at::randint(c.config.vocab_size, {2, c.seqlen}, at::kLong);
    ref_opt.zero_grad();
    off_opt.zero_grad();
    on_opt.zero_grad();
    const auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
    const auto off_loss = loss_and_backward(off->forward(tokens), targets);
    const auto on_loss = loss_and_backward(on->forward(tokens), targets);
    reduce_partial_grads(*off);
    reduce_partial_grads(*on);
    EXPECT_TRUE(identical(on_loss, off_loss)) << "loss";
    EXPECT_TRUE(close_to_scale(on_loss, ref_loss, tol)) << "loss against one device";
    for (const auto& [name, p] : on_p) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_TRUE(identical(p.grad(), off_p.at(name).grad())) << "gradient";
      EXPECT_TRUE(close_to_scale(whole(p.grad()), ref_p.at(name).grad(), tol))
          << "gradient against one device";
    }
    ref_opt.step();
    off_opt.step();
    on_opt.step();
    for (const auto& [name, p] : on_p) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(identical(p, off_p.at(name))) << "parameter after the step";
    }
  }
}

}  // namespace

TEST(LlamaOverlap, PiecesAreTheLargestDivisorOfTheShardUpToTheRequest) {
  EXPECT_EQ(tp::overlap_chunks(4, 2), 2);
  EXPECT_EQ(tp::overlap_chunks(6, 4), 3);
  EXPECT_EQ(tp::overlap_chunks(7, 4), 1);
  EXPECT_EQ(tp::overlap_chunks(2, 8), 2);
  EXPECT_EQ(tp::overlap_chunks(8, 0), 1);
}

// tp=2 with the tiny model's 2 KV heads and with 4; tp=4 needs 4 KV heads (wk/wv Colwise).
// seqlen 12 on 2 ranks asks for 4 pieces of 6 positions and gets 3.
TEST(LlamaOverlap, TrainingIsBitwiseTheSameAsWithoutOverlap) {
  for (int tp : {2, 4}) {
    run_ranks(tp, [tp](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
        expect_bitwise_training(mesh, {.config = tiny(4), .dtype = dtype});
        expect_bitwise_training(mesh,
                                {.config = tiny(4), .dtype = dtype, .seqlen = 16, .chunks = 4});
        expect_bitwise_training(
            mesh, {.config = tiny(4), .loss_parallel = false, .dtype = dtype, .chunks = 1});
        expect_bitwise_training(mesh, {.config = tiny(4), .loss_parallel = false, .dtype = dtype});
        // The output head is the embedding's weight: its gather too runs in pieces.
        expect_bitwise_training(mesh, {.config = tied(tiny(4)), .dtype = dtype});
        if (tp == 2) {
          expect_bitwise_training(mesh, {.config = tiny(2), .dtype = dtype});
          expect_bitwise_training(mesh,
                                  {.config = tiny(2), .dtype = dtype, .seqlen = 12, .chunks = 4});
        }
      }
    });
  }
}

// With P pieces per sequence shard, per step on L blocks: forward 2L*P all-gathers (+P for the
// head, +1 more gathering the logits without loss parallelism) and 2L*P + 1 reduce-scatters
// (+1: the embedding); backward 2L + 1 of each, as without overlap; one all-reduce for the
// norms' pending gradients; the vocab-parallel loss 3 all-reduces. P = 1 is the plan's own count.
TEST(LlamaOverlap, TrainingStepIssuesTheStatedCollectives) {
  for (int tp : {2, 4}) {
    run_ranks(tp, [](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      const auto config = tiny(4);
      const int64_t L = config.n_layers, seqlen = 16;
      for (const bool overlap : {false, true}) {
        for (const bool lp : {true, false}) {
          for (const int64_t chunks : {1, 2, 4}) {
            const int64_t P = overlap ? tp::overlap_chunks(seqlen / mesh.size(), chunks) : 1;
            SCOPED_TRACE(c10::str("overlap=", overlap, " lp=", lp, " chunks=", chunks, " P=", P));
            Transformer m =
                build({.config = config, .loss_parallel = lp, .chunks = chunks}, &mesh, overlap);
            torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3));
            for (int step = 0; step < 2; ++step) {
              auto tokens = at::randint(config.vocab_size, {2, seqlen}, at::kLong);
              auto targets = at::randint(config.vocab_size, {2, seqlen}, at::kLong);
              opt.zero_grad();
              CommDebugMode comm;
              auto logits = m->forward(tokens);
              EXPECT_EQ(
                  format_comm_counts(comm.get_comm_counts()),
                  format_comm_counts({{RS, 2 * L * P + 1}, {AG, (2 * L + 1) * P + (lp ? 0 : 1)}}))
                  << "forward";
              comm.enter();
              auto loss = token_cross_entropy(logits, targets);
              comm.enter();
              loss.backward();
              EXPECT_EQ(format_comm_counts(comm.get_comm_counts()),
                        format_comm_counts({{AG, 2 * L + 1}, {RS, 2 * L + 1}}))
                  << "backward";
              comm.enter();
              reduce_partial_grads(*m);
              opt.step();
              EXPECT_EQ(format_comm_counts(comm.get_comm_counts()), format_comm_counts({{AR, 1}}))
                  << "gradient reduction and optimizer";
            }
          }
        }
      }
    });
  }
}

TEST(LlamaOverlap, RefusesWhatItCannotOverlapNamingTheFix) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    Transformer no_sp(tiny(4));
    EXPECT_ERROR(
        apply_tensor_parallel(*no_sp, mesh, {.sequence_parallel = false, .overlap_comm = true}),
        c10::Error, "overlap_comm", "needs sequence_parallel=true", "set overlap_comm=false");
    Transformer gqa(tiny(2));
    EXPECT_ERROR(apply_tensor_parallel(*gqa, mesh, {.overlap_comm = true}), c10::Error,
                 "overlap_comm needs", "n_kv_heads=2 and tp=4");
    Transformer zero(tiny(4));
    EXPECT_ERROR(apply_tensor_parallel(*zero, mesh, {.overlap_comm = true, .overlap_chunks = 0}),
                 c10::Error, "overlap_chunks must be at least 1, got 0");
    // The functions name what they expect.
    Transformer plain(tiny(4));
    auto x = at::randn({2, 2, 32});
    EXPECT_ERROR(tp::all_gather_matmul(x, {plain->block(0).attention->wq->weight}, mesh, 2),
                 c10::Error, "tp::all_gather_matmul", "expected a 2-D DTensor Linear weight",
                 "a plain tensor", "ColwiseParallel");
  });
}
