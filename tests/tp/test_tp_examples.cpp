// The end-to-end examples of PyTorch's test_tp_examples.py: an MLP and PyTorch's toy Transformer
// parallelized with parallelize_module, trained next to a single-device copy built from the same
// seed. Exact collective counts for forward, backward and the optimizer step (docs/ARCHITECTURE.md,
// "Expected collective counts"), per module too; outputs, gradients and parameters equal the
// single-device model's.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <set>

#include "dtensor/dtensor.h"
#include "dtensor/tp/partial_grads.h"
#include "support/comm_counts.h"
#include "support/distributed.h"

using namespace dtensor;
using namespace dtensor::tp;
using dtensor::testing::AG;
using dtensor::testing::AR;
using dtensor::testing::RS;
using dtensor::testing::run_ranks;

namespace {

// ---- models (torch.testing._internal.distributed._tensor.common_dtensor) ----

struct MlpImpl : dtensor::nn::Module {
  dtensor::nn::Linear net1{nullptr}, net2{nullptr};
  explicit MlpImpl(c10::ScalarType dtype = at::kFloat) {
    at::manual_seed(5);
    net1 = register_module("net1", dtensor::nn::Linear(10, 16));
    net2 = register_module("net2", dtensor::nn::Linear(16, 10));
    to(dtype);
  }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& x) { return net2(net1(x).relu()); }, x);
  }
};
TORCH_MODULE(Mlp);

struct ModelArgs {
  int64_t n_layers = 2;
  int64_t vocab_size = 8;
  int64_t max_seq_len = 16;
  int64_t dim = 16;
  int64_t n_heads = 4;
  double dropout_p = 0.0;  // PyTorch's tests disable dropout to compare with one device
  bool use_attn_mask = true;
  bool weight_tying = true;
};

dtensor::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return dtensor::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

struct AttentionImpl : dtensor::nn::Module {
  int64_t n_heads, head_dim;
  bool causal;
  dtensor::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  dtensor::nn::Dropout resid_dropout{nullptr};
  explicit AttentionImpl(const ModelArgs& a)
      : n_heads(a.n_heads), head_dim(a.dim / a.n_heads), causal(a.use_attn_mask) {
    wq = register_module("wq", linear(a.dim, a.dim, false));
    wk = register_module("wk", linear(a.dim, a.dim, false));
    wv = register_module("wv", linear(a.dim, a.dim, false));
    wo = register_module("wo", linear(a.dim, a.dim, false));
    resid_dropout = register_module("resid_dropout", dtensor::nn::Dropout(a.dropout_p));
  }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward(
        [this](const at::Tensor& x) {
          const int64_t bsz = x.size(0), seq_len = x.size(1);
          auto heads = [&](const at::Tensor& t) {
            return t.view({bsz, seq_len, n_heads, head_dim}).transpose(1, 2);
          };
          auto out = at::scaled_dot_product_attention(heads(wq(x)), heads(wk(x)), heads(wv(x)),
                                                      std::nullopt, 0.0, causal);
          out = out.transpose(1, 2).contiguous().view({bsz, seq_len, -1});
          return resid_dropout(wo(out));
        },
        x);
  }
};
TORCH_MODULE(Attention);

struct FeedForwardImpl : dtensor::nn::Module {
  dtensor::nn::Linear w1{nullptr}, w2{nullptr};
  dtensor::nn::Dropout resid_dropout{nullptr};
  FeedForwardImpl(int64_t dim, int64_t hidden, double dropout_p) {
    w1 = register_module("w1", dtensor::nn::Linear(dim, hidden));
    w2 = register_module("w2", dtensor::nn::Linear(hidden, dim));
    resid_dropout = register_module("resid_dropout", dtensor::nn::Dropout(dropout_p));
  }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& x) { return resid_dropout(w2(at::gelu(w1(x)))); },
                        x);
  }
};
TORCH_MODULE(FeedForward);

dtensor::nn::LayerNorm layer_norm(int64_t dim) {
  return dtensor::nn::LayerNorm(torch::nn::LayerNormOptions({dim}));
}

struct TransformerBlockImpl : dtensor::nn::Module {
  dtensor::nn::LayerNorm attention_norm{nullptr}, ffn_norm{nullptr};
  Attention attention{nullptr};
  FeedForward feed_forward{nullptr};
  explicit TransformerBlockImpl(const ModelArgs& a) {
    attention_norm = register_module("attention_norm", layer_norm(a.dim));
    attention = register_module("attention", Attention(a));
    ffn_norm = register_module("ffn_norm", layer_norm(a.dim));
    feed_forward = register_module("feed_forward", FeedForward(a.dim, 4 * a.dim, a.dropout_p));
  }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward(
        [this](const at::Tensor& x) {
          auto h = x + attention(attention_norm(x));
          return h + feed_forward(ffn_norm(h));
        },
        x);
  }
};
TORCH_MODULE(TransformerBlock);

// A toy transformer, partly inspired by nanoGPT.
struct TransformerImpl : dtensor::nn::Module {
  ModelArgs args;
  dtensor::nn::Embedding tok_embeddings{nullptr}, pos_embeddings{nullptr};
  dtensor::nn::Dropout dropout{nullptr};
  torch::nn::ModuleList layers;
  dtensor::nn::LayerNorm norm{nullptr};
  dtensor::nn::Linear output{nullptr};
  explicit TransformerImpl(const ModelArgs& a) : args(a) {
    tok_embeddings = register_module("tok_embeddings", dtensor::nn::Embedding(a.vocab_size, a.dim));
    pos_embeddings =
        register_module("pos_embeddings", dtensor::nn::Embedding(a.max_seq_len, a.dim));
    dropout = register_module("dropout", dtensor::nn::Dropout(a.dropout_p));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < a.n_layers; ++i) layers->push_back(TransformerBlock(a));
    norm = register_module("norm", layer_norm(a.dim));
    output = register_module("output", linear(a.dim, a.vocab_size, false));
    if (a.weight_tying) tie_weights();
  }
  void tie_weights() { replace_parameter(*output, "weight", tok_embeddings->weight); }
  at::Tensor forward(const at::Tensor& tokens) {
    return call_forward(
        [this](const at::Tensor& tokens) {
          const int64_t seq_len = tokens.size(1);
          TORCH_CHECK(seq_len <= args.max_seq_len);
          auto h = tok_embeddings(tokens);
          auto p = pos_embeddings(at::arange(seq_len, tokens.options()));
          h = dropout(h + p);
          for (const auto& layer : *layers) h = layer->as<TransformerBlockImpl>()->forward(h);
          return output(norm(h)).to(at::kFloat);
        },
        tokens);
  }
};
TORCH_MODULE(Transformer);

// Transformer.parallelize of common_dtensor.py.
void parallelize_transformer(TransformerImpl& m, const DeviceMesh& mesh, bool seq_parallel,
                             bool local_output_for_attn) {
  if (seq_parallel) {
    parallelize_module(
        m, mesh,
        ParallelizePlan{
            {"tok_embeddings",
             RowwiseParallel({.input_layouts = Replicate(), .output_layouts = Shard(1)})},
            {"pos_embeddings",
             RowwiseParallel({.input_layouts = Replicate(), .output_layouts = Shard(0)})},
            {"norm", SequenceParallel()}});
  } else {
    parallelize_module(
        m, mesh,
        ParallelizePlan{
            {"tok_embeddings",
             RowwiseParallel({.input_layouts = Replicate(), .output_layouts = Replicate()})},
            {"pos_embeddings",
             RowwiseParallel({.input_layouts = Replicate(), .output_layouts = Replicate()})}});
  }
  for (const auto& layer : *m.layers) {
    ParallelizePlan plan;
    if (seq_parallel) {
      plan.emplace_back("attention",
                        PrepareModuleInput({.input_layouts = Layouts{Shard(1)},
                                            .desired_input_layouts = Layouts{Replicate()}}));
      plan.emplace_back("attention_norm", SequenceParallel());
      plan.emplace_back("ffn_norm", SequenceParallel());
    }
    for (const char* w : {"attention.wq", "attention.wk", "attention.wv"})
      plan.emplace_back(w, ColwiseParallel({.use_local_output = local_output_for_attn}));
    plan.emplace_back("attention.wo", seq_parallel ? RowwiseParallel({.output_layouts = Shard(1)})
                                                   : RowwiseParallel());
    plan.emplace_back("feed_forward.w1", seq_parallel ? ColwiseParallel({.input_layouts = Shard(1)})
                                                      : ColwiseParallel());
    plan.emplace_back("feed_forward.w2", seq_parallel
                                             ? RowwiseParallel({.output_layouts = Shard(1)})
                                             : RowwiseParallel());
    parallelize_module(*layer, mesh, plan);
  }
  parallelize_module(
      *m.output, mesh,
      seq_parallel ? ColwiseParallel({.input_layouts = Shard(1), .output_layouts = Replicate()})
                   : ColwiseParallel({.output_layouts = Replicate()}));
  if (local_output_for_attn) {
    for (const auto& layer : *m.layers)
      layer->as<TransformerBlockImpl>()->attention->n_heads = m.args.n_heads / mesh.size();
  }
  // Tie again so that the parameter and its gradient are one DTensor.
  if (m.args.weight_tying) m.tie_weights();
}

// ---- helpers ----

// Parameters without the duplicates that tied weights give (Python's parameters() dedups).
std::vector<at::Tensor> unique_params(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : m.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

at::Tensor global(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t.detach()) : t; }

// _check_module: every parameter (or gradient) of `tp` equals the single-device one.
void check_module(torch::nn::Module& ref, torch::nn::Module& tp, bool grad, double tol) {
  auto tp_params = tp.named_parameters();
  for (const auto& p : ref.named_parameters()) {
    SCOPED_TRACE((grad ? "grad of " : "") + p.key());
    const at::Tensor* q = tp_params.find(p.key());
    ASSERT_NE(q, nullptr);
    if (grad) {
      ASSERT_EQ(q->grad().defined(), p.value().grad().defined());
      if (!p.value().grad().defined()) continue;
      EXPECT_TENSOR_CLOSE(global(q->grad()), p.value().grad(), tol, tol);
    } else {
      EXPECT_TENSOR_CLOSE(global(*q), p.value().detach(), tol, tol);
    }
  }
}

}  // namespace

// ---- MLP training ----

TEST(TpExamples, MlpTrainingColwiseRowwiseAllReducesOnceAndMatchesOneDevice) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    at::manual_seed(0);
    auto inp = at::rand({8, 10});
    Mlp model, model_tp;
    parallelize_module(*model_tp, mesh,
                       ParallelizePlan{{"net1", ColwiseParallel()}, {"net2", RowwiseParallel()}});
    torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.25));
    torch::optim::SGD optim_tp(model_tp->parameters(), torch::optim::SGDOptions(0.25));

    auto output = model(inp);
    output.sum().backward();
    CommDebugMode comm;
    auto output_tp = model_tp(inp);
    output_tp.sum().backward();
    EXPECT_EQ(comm.get_comm_counts(), (CommCounts{{AR, 1}})) << comm.module_table();
    auto m = comm.comm_module_counts();
    EXPECT_EQ(m["net2"]["forward"], (CommCounts{{AR, 1}})) << comm.module_table();
    comm.exit();

    EXPECT_TENSOR_CLOSE(output_tp, output, 1e-5, 1e-6);
    check_module(*model, *model_tp, /*grad=*/true, 1e-5);
    optim.step();
    comm.enter();
    optim_tp.step();
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    comm.exit();
    check_module(*model, *model_tp, /*grad=*/false, 1e-5);
    inp = at::rand({8, 10});
    EXPECT_TENSOR_CLOSE(model_tp(inp), model(inp), 1e-5, 1e-6);
  });
}

TEST(TpExamples, MlpTrainingSequenceParallelGathersTwiceReduceScattersOnce) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    // Each rank feeds its own rows; the single device sees all ranks' rows together.
    std::vector<at::Tensor> rows;
    for (int r = 0; r < 4; ++r) {
      at::manual_seed(r);
      rows.push_back(at::rand({8, 10}));
    }
    const at::Tensor inp = rows[rank];
    Mlp model, model_tp;
    parallelize_module(*model_tp, mesh,
                       ParallelizePlan{{"net1", ColwiseParallel({.input_layouts = Shard(0)})},
                                       {"net2", RowwiseParallel({.output_layouts = Shard(0)})}});
    torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.25));
    torch::optim::SGD optim_tp(model_tp->parameters(), torch::optim::SGDOptions(0.25));

    auto output = model(at::cat(rows));
    output.sum().backward();
    CommDebugMode comm;
    auto output_tp = model_tp(inp);
    output_tp.sum().backward();
    EXPECT_EQ(comm.get_comm_counts(), (CommCounts{{AG, 2}, {RS, 1}})) << comm.module_table();
    comm.exit();
    EXPECT_TENSOR_CLOSE(output_tp, output.slice(0, 8 * rank, 8 * (rank + 1)), 1e-5, 1e-6);
    check_module(*model, *model_tp, /*grad=*/true, 1e-5);
    optim.step();
    optim_tp.step();
    check_module(*model, *model_tp, /*grad=*/false, 1e-5);
  });
}

// ---- Transformer training ----

namespace {

struct ExpCommCounts {
  CommCounts fwd, bwd, optim;
};

struct TransformerPair {
  Transformer model{nullptr}, model_tp{nullptr};
  std::unique_ptr<torch::optim::Adam> optim, optim_tp;
};

TransformerPair setup_transformer(const ModelArgs& args, const DeviceMesh& mesh, bool seq_parallel,
                                  c10::ScalarType dtype) {
  TransformerPair t;
  at::manual_seed(0);
  t.model = Transformer(args);
  at::manual_seed(0);
  t.model_tp = Transformer(args);
  t.model->to(dtype);  // converts in place (set_data): tied weights stay tied
  t.model_tp->to(dtype);
  parallelize_transformer(*t.model_tp, mesh, seq_parallel,
                          /*local_output_for_attn=*/dtype == at::kDouble);
  t.optim = std::make_unique<torch::optim::Adam>(unique_params(*t.model),
                                                 torch::optim::AdamOptions(0.25));
  t.optim_tp = std::make_unique<torch::optim::Adam>(unique_params(*t.model_tp),
                                                    torch::optim::AdamOptions(0.25));
  return t;
}

double tolerance(c10::ScalarType dtype) { return dtype == at::kDouble ? 1e-10 : 1e-4; }

// One training step on both models: forward, backward and the optimizer step, each checked
// against the single-device model and its collective counts. The Partial gradients of the
// sequence-parallel norms are settled by reduce_partial_grads before the step.
void train_step(TransformerPair& t, const at::Tensor& inp, const ExpCommCounts* expected,
                double tol, CommModuleCounts* fwd_modules = nullptr,
                CommModuleCounts* bwd_modules = nullptr) {
  auto output = t.model(inp);
  CommDebugMode comm;
  auto output_tp = t.model_tp(inp);
  comm.exit();
  EXPECT_TENSOR_CLOSE(output_tp, output, tol, tol);
  if (expected) {
    EXPECT_EQ(comm.get_comm_counts(), expected->fwd) << comm.module_table();
  }
  if (fwd_modules) *fwd_modules = comm.comm_module_counts();

  output.sum().backward();
  comm.enter();
  output_tp.sum().backward();
  comm.exit();
  if (expected) {
    EXPECT_EQ(comm.get_comm_counts(), expected->bwd) << comm.module_table();
  }
  if (bwd_modules) *bwd_modules = comm.comm_module_counts();
  check_module(*t.model, *t.model_tp, /*grad=*/true, tol);

  t.optim->step();
  comm.enter();
  reduce_partial_grads(*t.model_tp);
  t.optim_tp->step();
  comm.exit();
  if (expected) {
    EXPECT_EQ(comm.get_comm_counts(), expected->optim) << comm.table();
  }
  check_module(*t.model, *t.model_tp, /*grad=*/false, tol);
  t.optim->zero_grad();
  t.optim_tp->zero_grad();
}

// PyTorch's counts, except the optimizer step of the sequence-parallel model: PyTorch's Adam
// re-reduces the 10 Partial norm gradients in each of its 3 ops that read them (all_reduce
// 30); reduce_partial_grads settles all 10 in one coalesced all_reduce first.
const ExpCommCounts kBase{{{AR, 6}, {AG, 1}}, {{AR, 9}}, {}};
const ExpCommCounts kSeqParallel{{{RS, 6}, {AG, 6}}, {{RS, 5}, {AG, 6}}, {{AR, 1}}};

void transformer_training(bool seq_parallel, c10::ScalarType dtype, int steps) {
  auto mesh = init_device_mesh("cpu", {4});
  ModelArgs args;
  auto t = setup_transformer(args, mesh, seq_parallel, dtype);
  at::manual_seed(0);
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    auto inp = at::randint(args.vocab_size, {8, 8});
    train_step(t, inp, seq_parallel ? &kSeqParallel : &kBase, tolerance(dtype));
  }
}

}  // namespace

TEST(TpExamples, TransformerTrainingMatchesOneDeviceWithPyTorchsCounts) {
  run_ranks(4, [](int) {
    for (bool seq_parallel : {false, true}) {
      for (auto dtype : {at::kFloat, at::kDouble}) {
        SCOPED_TRACE(std::string(seq_parallel ? "sequence parallel " : "") + c10::toString(dtype));
        transformer_training(seq_parallel, dtype, /*steps=*/3);
      }
    }
  });
}

TEST(TpExamples, TransformerCountsCollectivesPerModule) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    ModelArgs args;
    for (bool seq_parallel : {false, true}) {
      SCOPED_TRACE(seq_parallel ? "sequence parallel" : "");
      auto t = setup_transformer(args, mesh, seq_parallel, at::kFloat);
      at::manual_seed(0);
      CommModuleCounts fwd, bwd;
      train_step(t, at::randint(args.vocab_size, {8, 8}), nullptr, tolerance(at::kFloat), &fwd,
                 &bwd);
      for (const char* layer : {"layers.0", "layers.1"}) {
        const std::string l = layer;
        SCOPED_TRACE(l);
        if (!seq_parallel) {
          EXPECT_EQ(fwd[l + ".attention.wo"]["forward"], (CommCounts{{AR, 1}}));
          EXPECT_EQ(fwd[l + ".feed_forward.w2"]["forward"], (CommCounts{{AR, 1}}));
          EXPECT_EQ(fwd[l]["forward"], (CommCounts{{AR, 2}}));
          for (const char* w :
               {".attention.wq", ".attention.wk", ".attention.wv", ".feed_forward.w1"})
            EXPECT_EQ(bwd[l + w]["backward"], (CommCounts{{AR, 1}})) << w;
          EXPECT_EQ(bwd[l + ".attention"]["backward"], (CommCounts{{AR, 3}}));
          EXPECT_EQ(bwd[l]["backward"], (CommCounts{{AR, 4}}));
          EXPECT_EQ(bwd.count(l + ".attention.wo"), 0u);
        } else {
          // The attention's input gather (PrepareModuleInput) belongs to the attention.
          EXPECT_EQ(fwd[l + ".attention"]["forward"], (CommCounts{{AG, 1}, {RS, 1}}));
          EXPECT_EQ(fwd[l + ".attention.wo"]["forward"], (CommCounts{{RS, 1}}));
          EXPECT_EQ(fwd[l + ".feed_forward.w1"]["forward"], (CommCounts{{AG, 1}}));
          EXPECT_EQ(fwd[l]["forward"], (CommCounts{{AG, 2}, {RS, 2}}));
          EXPECT_EQ(bwd[l + ".attention"]["backward"], (CommCounts{{AG, 1}, {RS, 1}}));
          EXPECT_EQ(bwd[l + ".attention.wo"]["backward"], (CommCounts{{AG, 1}}));
          EXPECT_EQ(bwd[l + ".feed_forward.w1"]["backward"], (CommCounts{{RS, 1}}));
          EXPECT_EQ(bwd[l + ".feed_forward.w2"]["backward"], (CommCounts{{AG, 1}}));
          EXPECT_EQ(bwd[l]["backward"], (CommCounts{{AG, 2}, {RS, 2}}));
          EXPECT_EQ(bwd.count(l + ".attention_norm"), 0u);
        }
      }
      if (!seq_parallel) {
        EXPECT_EQ(fwd["tok_embeddings"]["forward"], (CommCounts{{AR, 1}}));
        EXPECT_EQ(fwd["pos_embeddings"]["forward"], (CommCounts{{AR, 1}}));
        EXPECT_EQ(fwd["output"]["forward"], (CommCounts{{AG, 1}}));
        EXPECT_EQ(bwd["output"]["backward"], (CommCounts{{AR, 1}}));
        EXPECT_EQ(fwd["Global"]["forward"], kBase.fwd);
        EXPECT_EQ(bwd["Global"]["backward"], kBase.bwd);
      } else {
        EXPECT_EQ(fwd["tok_embeddings"]["forward"], (CommCounts{{RS, 1}}));
        EXPECT_EQ(bwd["tok_embeddings"]["backward"], (CommCounts{{AG, 1}}));
        EXPECT_EQ(fwd["pos_embeddings"]["forward"], (CommCounts{{RS, 1}}));
        EXPECT_EQ(bwd["pos_embeddings"]["backward"], (CommCounts{{AG, 1}}));
        EXPECT_EQ(fwd["output"]["forward"], (CommCounts{{AG, 2}}));
        EXPECT_EQ(bwd["output"]["backward"], (CommCounts{{RS, 1}}));
        EXPECT_EQ(fwd["Global"]["forward"], kSeqParallel.fwd);
        EXPECT_EQ(bwd["Global"]["backward"], kSeqParallel.bwd);
      }
    }
  });
}

// ---- partial requires_grad ----

TEST(TpExamples, TransformerWithFrozenParametersCommunicatesOnlyForTrainedOnes) {
  struct Case {
    std::vector<std::string> thaw;  // empty: all parameters train
    bool seq_parallel;
    c10::ScalarType dtype;
    CommCounts bwd, optim;  // optim: PyTorch's in the comment
  };
  const std::vector<Case> cases = {
      {{}, true, at::kFloat, {{RS, 5}, {AG, 6}}, {{AR, 1}}},  // PyTorch: all_reduce 30
      {{}, false, at::kDouble, {{AR, 9}}, {}},
      {{"output.weight", "norm.weight", "norm.bias"}, true, at::kFloat, {{RS, 1}}, {{AR, 1}}},  // 6
      {{"tok_embeddings.weight", "output.weight"}, true, at::kFloat, {{RS, 5}, {AG, 5}}, {}},
      {{"tok_embeddings.weight", "output.weight", "norm.weight", "norm.bias"},
       true,
       at::kFloat,
       {{RS, 5}, {AG, 5}},
       {{AR, 1}}},  // PyTorch: 6
      {{"tok_embeddings.weight", "output.weight", "norm.weight", "norm.bias",
        "layers.1.ffn_norm.weight", "layers.1.ffn_norm.bias"},
       true,
       at::kFloat,
       {{RS, 5}, {AG, 5}},
       {{AR, 1}}},  // PyTorch: 12
      {{"tok_embeddings.weight", "layers.0.attention.wv.weight", "layers.0.feed_forward.w1.bias",
        "layers.1.ffn_norm.bias", "layers.1.feed_forward.w2.weight", "output.weight"},
       true,
       at::kFloat,
       {{RS, 5}, {AG, 5}},
       {{AR, 1}}},  // PyTorch: 3
  };
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {4});
    ModelArgs args;
    args.weight_tying = false;
    for (const auto& c : cases) {
      SCOPED_TRACE("thaw " + c10::Join(", ", c.thaw));
      auto t = setup_transformer(args, mesh, c.seq_parallel, c.dtype);
      if (!c.thaw.empty()) {
        for (torch::nn::Module* m : {static_cast<torch::nn::Module*>(t.model.get()),
                                     static_cast<torch::nn::Module*>(t.model_tp.get())})
          for (auto& p : m->named_parameters())
            if (std::find(c.thaw.begin(), c.thaw.end(), p.key()) == c.thaw.end())
              p.value().requires_grad_(false);
      }
      at::manual_seed(0);
      auto inp = at::randint(args.vocab_size, {8, 8});
      const ExpCommCounts expected{c.seq_parallel ? kSeqParallel.fwd : kBase.fwd, c.bwd, c.optim};
      train_step(t, inp, &expected, tolerance(c.dtype));
    }
  });
}

// ---- weight tying ----

TEST(TpExamples, TiedWeightsShareOneGradient) {
  struct TiedImpl : dtensor::nn::Module {
    dtensor::nn::Embedding embedding{nullptr};
    dtensor::nn::Linear fc{nullptr};
    TiedImpl() {
      at::manual_seed(1);
      embedding = register_module("embedding", dtensor::nn::Embedding(16, 8));
      at::manual_seed(2);
      fc = register_module("fc", dtensor::nn::Linear(8, 16));
    }
    at::Tensor forward(const at::Tensor& x) {
      return call_forward([this](const at::Tensor& x) { return fc(embedding(x)); }, x);
    }
  };
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto model = std::make_shared<TiedImpl>();
    parallelize_module(
        *model, mesh, ParallelizePlan{{"embedding", ColwiseParallel()}, {"fc", RowwiseParallel()}});
    at::manual_seed(0);
    auto inp = at::randint(16, {5});
    auto local = [](const at::Tensor& t) { return local_tensor(t); };
    EXPECT_FALSE(at::equal(local(model->embedding->weight), local(model->fc->weight)));
    model->forward(inp).sum().backward();
    EXPECT_FALSE(
        at::equal(local(model->embedding->weight.grad()), local(model->fc->weight.grad())));
    model->zero_grad();

    replace_parameter(*model->fc, "weight", model->embedding->weight);
    EXPECT_TRUE(model->fc->weight.is_same(model->embedding->weight));
    EXPECT_TRUE(model->fc->named_parameters()["weight"].is_same(model->embedding->weight));
    auto out = model->forward(inp);
    out.sum().backward();
    EXPECT_TRUE(model->fc->weight.grad().is_same(model->embedding->weight.grad()));

    // Against one device: embedding and fc share the embedding's initial weight.
    auto ref = std::make_shared<TiedImpl>();
    replace_parameter(*ref->fc, "weight", ref->embedding->weight);
    auto ref_out = ref->forward(inp);
    ref_out.sum().backward();
    EXPECT_TENSOR_CLOSE(out, ref_out, 1e-5, 1e-6);
    EXPECT_TENSOR_CLOSE(full_tensor(model->embedding->weight.grad()), ref->embedding->weight.grad(),
                        1e-5, 1e-6);
  });
}
