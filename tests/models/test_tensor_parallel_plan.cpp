// The Llama model under tensor parallelism: for TP degrees 1-4, with and without sequence
// parallelism and loss parallelism, with GQA where tp exceeds the KV heads, tied embeddings and a
// vocabulary the ranks split unevenly, three AdamW steps give the same loss, every gradient and
// every parameter as the unparallelized model from the same seed; a training step issues exactly
// the analytic minimum of collectives.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <map>
#include <string>

#include "dtensor/dtensor.h"
#include "dtensor/models/meta_init.h"
#include "dtensor/models/transformer.h"
#include "support/comm_counts.h"
#include "support/distributed.h"
#include "support/memory.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

DecoderConfig tiny(int64_t n_kv_heads = 2) {
  auto c = DecoderConfig::preset("tiny");
  c.vocab_size = 64;
  c.n_kv_heads = n_kv_heads;
  return c;
}

struct Case {
  std::string label;
  DecoderConfig config;
  TensorParallelOptions options;
  at::ScalarType dtype = at::kDouble;
  double tol = 1e-9;
  int64_t seqlen = 8;
  bool empty = false;  // the TP model from empty_transformer + init_weights
};

// Three AdamW steps on the TP model and on the plain one, comparing the loss, every gradient
// (after reduce_partial_grads) and every parameter after each step.
void expect_training_matches(const DeviceMesh& mesh, const Case& c) {
  SCOPED_TRACE(c.label + " on tp=" + std::to_string(mesh.size()));
  Transformer ref(c.config);
  ref->to(c.dtype);
  ref->init_weights(11);
  Transformer model{nullptr};
  if (c.empty) {
    model = empty_transformer(c.config, c.dtype, mesh, c.options);
    model->init_weights(11);
  } else {
    model = Transformer(c.config);
    model->to(c.dtype);
    model->init_weights(11);
    apply_tensor_parallel(*model, mesh, c.options);
  }
  const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW ref_opt(ref->parameters(), opt), tp_opt(model->parameters(), opt);

  const auto ref_params = params_of(*ref), tp_params = params_of(*model);
  ASSERT_EQ(ref_params.size(), tp_params.size());
  for (const auto& [name, p] : tp_params) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(close_to_scale(whole(p), ref_params.at(name), 0.0)) << "initial value";
  }
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Identical on every rank: run_ranks seeds each rank alike.
    auto tokens = at::randint(c.config.vocab_size, {2, c.seqlen}, at::kLong);
    auto targets = at::randint(c.config.vocab_size, {2, c.seqlen}, at::kLong);
    ref_opt.zero_grad();
    tp_opt.zero_grad();
    // With experts, the loss includes the auxiliary loss (training_loss).
    at::Tensor ref_loss = training_loss(*ref, ref->forward(tokens), targets);
    ref_loss.backward();
    auto logits = model->forward(tokens);
    EXPECT_EQ(is_dtensor(logits), c.options.loss_parallel);
    at::Tensor loss = training_loss(*model, logits, targets);
    loss.backward();
    reduce_partial_grads(*model);
    EXPECT_TRUE(close_to_scale(loss, ref_loss, c.tol)) << "loss";
    for (const auto& [name, p] : tp_params) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(p.grad().defined());
      if (is_dtensor(p.grad())) {
        EXPECT_FALSE(spec_of(p.grad()).has_partial());
      }
      EXPECT_TRUE(close_to_scale(whole(p.grad()), ref_params.at(name).grad(), c.tol)) << "gradient";
    }
    ref_opt.step();
    tp_opt.step();
    for (const auto& [name, p] : tp_params) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(close_to_scale(whole(p), ref_params.at(name), c.tol))
          << "parameter after the step";
    }
  }
}

const TensorParallelOptions kSpLp{.sequence_parallel = true, .loss_parallel = true};
const TensorParallelOptions kSp{.sequence_parallel = true, .loss_parallel = false};
const TensorParallelOptions kLp{.sequence_parallel = false, .loss_parallel = true};
const TensorParallelOptions kPlain{.sequence_parallel = false, .loss_parallel = false};

}  // namespace

// tp=2 splits the 2 KV heads, tp=4 replicates them (each rank keeps the one its 1 query head
// uses); tp=1 is the degenerate mesh.
TEST(LlamaTp, TrainingMatchesOneDeviceForEveryPlanVariant) {
  for (int tp : {1, 2, 4}) {
    run_ranks(tp, [](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      for (const auto& [name, options] : std::vector<std::pair<std::string, TensorParallelOptions>>{
               {"SP + loss parallel", kSpLp},
               {"SP", kSp},
               {"loss parallel", kLp},
               {"Megatron (no SP, no loss parallel)", kPlain}}) {
        expect_training_matches(mesh, {name, tiny(2), options});
      }
    });
  }
}

TEST(LlamaTp, Float32TrainingMatchesOneDeviceWithin1e5) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    expect_training_matches(mesh, {"float32 SP + loss parallel", tiny(2), kSpLp, at::kFloat, 1e-5});
    expect_training_matches(mesh, {"float32 Megatron", tiny(2), kPlain, at::kFloat, 1e-5});
  });
}

// KV heads that do not split over the ranks: MQA (1 KV head) on 4 ranks, and 6 query heads
// sharing 3 KV heads on 2 ranks, where rank 0's query heads 0-2 use KV heads 0, 0, 1.
TEST(LlamaTp, GroupedKvHeadsFewerThanOrNotDividingTpMatchOneDevice) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    expect_training_matches(mesh, {"MQA SP + LP", tiny(1), kSpLp});
    expect_training_matches(mesh, {"MQA Megatron", tiny(1), kPlain});
  });
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto c = tiny(3);
    c.dim = 48;
    c.n_heads = 6;
    expect_training_matches(mesh, {"6 heads / 3 KV SP + LP", c, kSpLp});
    expect_training_matches(mesh, {"6 heads / 3 KV Megatron", c, kPlain});
  });
}

TEST(LlamaTp, TiedEmbeddingsStayTiedAndMatchOneDevice) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto c = tiny(2);
    c.tie_embeddings = true;
    for (const auto& options : {kSpLp, kSp, kLp, kPlain}) {
      expect_training_matches(mesh, {"tied", c, options});
    }
    Transformer m(c);
    apply_tensor_parallel(*m, mesh);
    EXPECT_TRUE(m->output->weight.is_same(m->tok_embeddings->weight));
    EXPECT_EQ(placements(m->tok_embeddings->weight)[0], Shard(0));
  });
}

// 61 tokens over 4 ranks: vocab shards of 16, 16, 16, 13 for the embedding, the head and the
// vocab-parallel loss.
TEST(LlamaTp, VocabularyNotDivisibleByTpMatchesOneDevice) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto c = tiny(2);
    c.vocab_size = 61;
    expect_training_matches(mesh, {"vocab 61 SP + LP", c, kSpLp});
    expect_training_matches(mesh, {"vocab 61 Megatron", c, kPlain});
    c.tie_embeddings = true;
    expect_training_matches(mesh, {"vocab 61 tied SP + LP", c, kSpLp});
  });
}

TEST(LlamaTp, InitWeightsAfterParallelizingKeepsTheSameModel) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    Transformer ref(tiny(1)), model(tiny(1));
    ref->init_weights(5);
    apply_tensor_parallel(*model, mesh);
    CommDebugMode comm;
    model->init_weights(5);
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    auto rp = params_of(*ref);
    for (const auto& [name, p] : params_of(*model)) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(is_dtensor(p));
      EXPECT_TENSOR_EQ(whole(p), rp.at(name));
    }
  });
}

// empty_transformer allocates only each rank's parameters (every byte counted by the CPU
// allocator: its shards, the replicated norms and KV projections, and the rotary table) and,
// filled by init_weights, trains as the model built whole: KV heads sharded (tp=2) and
// replicated (tp=4), tied and untied.
TEST(LlamaTp, EmptyTransformerAllocatesOnlyLocalParametersAndTrainsTheSame) {
  for (int tp : {2, 4}) {
    run_ranks(tp, [tp](int) {
      auto mesh = init_device_mesh("cpu", {tp});
      for (bool tied : {false, true}) {
        DecoderConfig c = tiny();
        c.tie_embeddings = tied;
        int64_t peak = 0;
        Transformer model{nullptr};
        {
          CountCpuBytes count;
          model = empty_transformer(c, at::kDouble, mesh);
          peak = count.peak();
        }
        int64_t local = 0;
        for (const auto& p : model->parameters()) {
          EXPECT_TRUE(is_dtensor(p));
          local += local_tensor(p).nbytes();
        }
        // The table, and its angles, cos and sin while it is stacked.
        const int64_t rope = 3 * c.max_seq_len * c.head_dim() * 8;
        EXPECT_LE(peak, local + rope) << "tp=" << tp << " tied=" << tied;
        EXPECT_LT(local + rope, c.num_parameters() * 8);
        expect_training_matches(mesh, {"empty_transformer", c, {}, at::kDouble, 1e-9, 8, true});
      }
    });
  }
}

TEST(LlamaTp, PlanRefusesWhatItCannotShardNamingTheFix) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto message = [](const std::function<void()>& f) {
      try {
        f();
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string("no error");
    };
    auto c = tiny(2);
    c.dim = 48;
    c.n_heads = 6;
    c.ffn_hidden_dim = 192;
    Transformer six(c);
    auto before = params_of(*six);
    EXPECT_NE(message([&] {
                apply_tensor_parallel(*six, mesh);
              }).find("n_heads=6 is not divisible by tp=4; valid tp degrees: 1, 2, 3, 6"),
              std::string::npos);
    for (const auto& [name, p] : params_of(*six)) EXPECT_FALSE(is_dtensor(p)) << name;

    Transformer m(tiny(2));
    apply_tensor_parallel(*m, mesh);
    EXPECT_NE(message([&] {
                m->forward(at::zeros({1, 6}, at::kLong));
              }).find("sequence length 6 is not divisible by tp=4"),
              std::string::npos);
    EXPECT_NE(message([&] { apply_tensor_parallel(*m, mesh); }).find("already parallelized"),
              std::string::npos);
    // Without sequence parallelism any length works.
    Transformer megatron(tiny(2)), ref(tiny(2));
    apply_tensor_parallel(*megatron, mesh, kPlain);
    auto tokens = at::randint(64, {1, 6}, at::kLong);
    EXPECT_TRUE(
        close_to_scale(megatron->forward(tokens).detach(), ref->forward(tokens).detach(), 1e-5));

    // A multi-dimensional mesh: its "tp" dimension, or an error when it has none.
    auto mesh2d = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    Transformer on2d(tiny(2));
    apply_tensor_parallel(*on2d, mesh2d);
    EXPECT_EQ(spec_of(on2d->block(0).attention->wq->weight).mesh().size(), 2);
    EXPECT_EQ(spec_of(on2d->block(0).attention->wq->weight).mesh(), *get_tp_mesh(mesh2d));
    auto tokens4 = at::randint(64, {1, 4}, at::kLong);
    EXPECT_TRUE(close_to_scale(full_tensor(on2d->forward(tokens4).detach()),
                               ref->forward(tokens4).detach(), 1e-5));
    EXPECT_NE(message([&] {
                apply_tensor_parallel(*ref, init_device_mesh("cpu", {2, 2}, {"dp", "cp"}));
              }).find("get_tp_mesh"),
              std::string::npos);
    ASSERT_TRUE(get_tp_mesh(mesh2d).has_value());
    EXPECT_EQ(get_tp_mesh(mesh2d)->size(), 2);
    EXPECT_EQ(get_tp_mesh(mesh2d)->dim_names(), std::vector<std::string>{"tp"});
    EXPECT_EQ(get_tp_mesh(mesh)->size(), 4);
    EXPECT_FALSE(get_tp_mesh(init_device_mesh("cpu", {2, 2}, {"dp", "cp"})).has_value());
  });
}

// ---- collective counts ----

namespace {

struct StepCounts {
  CommCounts forward, loss, backward, reduce, optimizer;
};

StepCounts count_step(Transformer& model, torch::optim::Optimizer& opt, int64_t vocab) {
  auto tokens = at::randint(vocab, {2, 8}, at::kLong);
  auto targets = at::randint(vocab, {2, 8}, at::kLong);
  StepCounts counts;
  opt.zero_grad();
  CommDebugMode comm;
  auto logits = model->forward(tokens);
  counts.forward = comm.get_comm_counts();
  comm.enter();
  auto loss = token_cross_entropy(logits, targets);
  counts.loss = comm.get_comm_counts();
  comm.enter();
  loss.backward();
  counts.backward = comm.get_comm_counts();
  comm.enter();
  reduce_partial_grads(*model);
  counts.reduce = comm.get_comm_counts();
  comm.enter();
  opt.step();
  counts.optimizer = comm.get_comm_counts();
  return counts;
}

void expect_counts(const StepCounts& got, const StepCounts& want) {
  EXPECT_EQ(format_comm_counts(got.forward), format_comm_counts(want.forward)) << "forward";
  EXPECT_EQ(format_comm_counts(got.loss), format_comm_counts(want.loss)) << "loss";
  EXPECT_EQ(format_comm_counts(got.backward), format_comm_counts(want.backward)) << "backward";
  EXPECT_EQ(format_comm_counts(got.reduce), format_comm_counts(want.reduce))
      << "reduce_partial_grads";
  EXPECT_EQ(format_comm_counts(got.optimizer), format_comm_counts(want.optimizer)) << "optimizer";
}

}  // namespace

// Per block with SP: forward 2 all_gathers (attention and FFN inputs) + 2 reduce_scatters
// (wo, w2), mirrored in backward; embedding 1 reduce_scatter forward / 1 all_gather backward;
// head 1 all_gather forward / 1 reduce_scatter backward; the vocab-parallel loss 3 all_reduces
// forward, none backward; one all_reduce for all sequence-parallel norm gradients (and the
// replicated KV projections' when tp > KV heads); nothing in the optimizer.
TEST(LlamaTp, TrainingStepIssuesTheAnalyticMinimumOfCollectives) {
  for (int tp : {2, 4}) {
    run_ranks(tp, [](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      const auto c = tiny(2);
      const int64_t L = c.n_layers;
      for (const auto& options : {kSpLp, kSp, kLp, kPlain}) {
        SCOPED_TRACE(c10::str("tp=", mesh.size(), " sp=", options.sequence_parallel,
                              " lp=", options.loss_parallel));
        Transformer model(c);
        model->to(at::kDouble);
        apply_tensor_parallel(*model, mesh, options);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
        const bool kv_replicated = c.kv_heads() % mesh.size() != 0;
        StepCounts want;
        if (options.sequence_parallel) {
          want.forward = {{RS, 1 + 2 * L}, {AG, 2 * L + 1 + (options.loss_parallel ? 0 : 1)}};
          want.backward = {{AG, 1 + 2 * L}, {RS, 2 * L + 1}};
          want.reduce = {{AR, 1}};
        } else {
          want.forward = {{AR, 1 + 2 * L}};
          if (!options.loss_parallel) want.forward[AG] = 1;
          want.backward = {{AR, 2 * L + 1}};
          if (kv_replicated) want.reduce = {{AR, 1}};
        }
        if (options.loss_parallel) want.loss = {{AR, 3}};
        const int64_t copies_before = dispatch::cache_stats().layout_copies;
        for (int step = 0; step < 2; ++step) {
          SCOPED_TRACE(step);
          expect_counts(count_step(model, opt, c.vocab_size), want);
        }
        // Every op's local result came back in the layout its rule announced: no extra copies.
        EXPECT_EQ(dispatch::cache_stats().layout_copies - copies_before, 0);
      }
    });
  }
}

// Mixture-of-experts decoders (all layers sparse, and a dense layer before a sparse one): three
// AdamW steps in float64 with the auxiliary loss equal one device's (loss, every gradient, every
// parameter within 1e-9), with and without sequence parallelism, and built on the meta device.
TEST(LlamaTp, MoeDecoderTrainingMatchesOneDeviceAuxLossIncluded) {
  for (int tp : {2, 4}) {
    run_ranks(tp, [](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      DecoderConfig moe = DecoderConfig::preset("tiny-moe");
      DecoderConfig mixed = moe;
      mixed.moe->sparse_layers = {false, true};
      expect_training_matches(mesh, {"MoE SP + LP", moe, kSpLp});
      expect_training_matches(mesh, {"MoE LP, dense layer 0", mixed, kLp});
      expect_training_matches(mesh, {"MoE empty SP + LP", mixed, kSpLp, at::kDouble, 1e-9, 8,
                                     /*empty=*/true});
    });
  }
}

// Expert parallelism folded over the tp ranks (TensorParallelOptions::ep = tp): each rank holds
// num_experts / tp whole experts and routes its sequence shard (SP) or its 1/tp of the tokens
// (without SP) to them by all-to-all; the router logits are gathered so that the auxiliary loss
// is the whole batch's. Three AdamW steps in float64 equal one device's (1e-9), dropless and with
// a capacity that drops nothing.
TEST(LlamaTp, MoeDecoderWithExpertParallelismMatchesOneDevice) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
    DecoderConfig moe = DecoderConfig::preset("tiny-moe");
    DecoderConfig mixed = moe;
    mixed.moe->sparse_layers = {false, true};
    TensorParallelOptions sp = kSpLp, plain = kLp;
    sp.ep = plain.ep = 2;
    TensorParallelOptions capacity = sp;
    capacity.expert_parallel = {.dispatch = MoeDispatch::kCapacity, .capacity_factor = 4.0};
    expect_training_matches(mesh, {"MoE EP SP + LP", moe, sp});
    expect_training_matches(mesh, {"MoE EP LP, dense layer 0", mixed, plain});
    expect_training_matches(mesh, {"MoE EP capacity SP + LP", moe, capacity});
  });
}

// Mixture-of-experts blocks (the "moe" sublayer's MoeParallel style, experts split like dense
// feed-forwards). Per sparse block, against a dense one's 2 all-gathers and 2 reduce-scatters
// each way: with SP the attention's as before, the block's input all-gathered and its output
// all-reduced forward (then cut to this rank's sequence shard), its output's gradient
// all-gathered and its input's gradient all-reduced backward; without SP one all-reduce each
// way. The router's Partial gradients join reduce_partial_grads' one all-reduce.
TEST(LlamaTp, MoeTrainingStepIssuesCollectivesByFormula) {
  for (int tp : {2, 4}) {
    run_ranks(tp, [](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      for (const std::vector<bool>& sparse : {std::vector<bool>{true, true}, {false, true}}) {
        DecoderConfig c = DecoderConfig::preset("tiny-moe");
        c.moe->sparse_layers = sparse;
        const int64_t L = c.n_layers, S = std::count(sparse.begin(), sparse.end(), true), D = L - S;
        for (const auto& options : {kSpLp, kLp}) {
          SCOPED_TRACE(c10::str("tp=", mesh.size(), " sparse layers ", S,
                                " sp=", options.sequence_parallel));
          Transformer model(c);
          model->to(at::kDouble);
          apply_tensor_parallel(*model, mesh, options);
          torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
          StepCounts want;
          if (options.sequence_parallel) {
            want.forward = {{RS, 1 + 2 * D + S}, {AG, 2 * L + 1}, {AR, S}};
            want.backward = {{AG, 1 + 2 * L}, {RS, 1 + 2 * D + S}, {AR, S}};
          } else {
            want.forward = {{AR, 1 + 2 * L}};
            want.backward = {{AR, 1 + 2 * L}};
          }
          want.reduce = {{AR, 1}};
          want.loss = {{AR, 3}};
          for (int step = 0; step < 2; ++step) {
            SCOPED_TRACE(step);
            expect_counts(count_step(model, opt, c.vocab_size), want);
          }
        }
      }
    });
  }
}

// Expert parallelism over the tp ranks (dropless), per sparse block against MoeParallel's: with
// SP no input all-gather and no output all-reduce, but the router logits' all-gather (for the
// auxiliary loss; this step's loss has none, so no reduce-scatter back) and the counts,
// dispatch and combine all-to-alls forward, the dispatch's and combine's backward; without SP the
// output's all-gather instead of its all-reduce forward, the input gradient's all-reduce as
// before. The router's Partial gradients join reduce_partial_grads' one all-reduce.
TEST(LlamaTp, MoeTrainingStepWithExpertParallelismIssuesCollectivesByFormula) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
    constexpr auto A2A = CommType::all_to_all_single;
    for (const std::vector<bool>& sparse : {std::vector<bool>{true, true}, {false, true}}) {
      DecoderConfig c = DecoderConfig::preset("tiny-moe");
      c.moe->sparse_layers = sparse;
      const int64_t L = c.n_layers, S = std::count(sparse.begin(), sparse.end(), true), D = L - S;
      for (TensorParallelOptions options : {kSpLp, kLp}) {
        options.ep = 2;
        SCOPED_TRACE(c10::str("sparse layers ", S, " sp=", options.sequence_parallel));
        Transformer model(c);
        model->to(at::kDouble);
        apply_tensor_parallel(*model, mesh, options);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
        StepCounts want;
        if (options.sequence_parallel) {
          want.forward = {{RS, 1 + 2 * D + S}, {AG, 2 * L + 1}, {A2A, 3 * S}};
          want.backward = {{AG, 1 + 2 * D + S}, {RS, 1 + 2 * D + S}, {A2A, 2 * S}};
        } else {
          want.forward = {{AR, 1 + L + D}, {AG, 2 * S}, {A2A, 3 * S}};
          want.backward = {{AR, 1 + 2 * L}, {A2A, 2 * S}};
        }
        want.reduce = {{AR, 1}};
        want.loss = {{AR, 3}};
        expect_counts(count_step(model, opt, c.vocab_size), want);
      }
    }
  });
}
