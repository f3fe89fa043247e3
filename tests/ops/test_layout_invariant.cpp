// LayoutInvariantMode: every sum over a TP-sharded dim in one canonical order, so TP 1 (a one-rank
// mesh), 2 and 4 give the same bits (compared with memcmp through files rank 0 writes, not within
// a tolerance): single products, a Transformer's logits and gradients under the Megatron plan,
// training steps with sequence parallelism, the vocab-parallel loss and clipping, and
// generation. (Not run under mpirun: each case compares runs of different world sizes.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <string>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/dtensor.h"
#include "dtensor/models/generate.h"
#include "dtensor/models/transformer.h"
#include "dtensor/nn/clip_grad.h"
#include "dtensor/ops/layout_invariant.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/temp_dir.h"

using namespace dtensor;
using namespace dtensor::testing;
namespace safetensors = dtensor::checkpoint::safetensors;

namespace {

// The Megatron plan: activations replicated between blocks, logits gathered.
dtensor::models::TensorParallelOptions megatron_plan() {
  dtensor::models::TensorParallelOptions options;
  options.sequence_parallel = false;
  options.loss_parallel = false;
  return options;
}

using Tensors = std::map<std::string, at::Tensor>;

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// Each tensor of `got` has the bits of the same-named one in `want`.
void expect_same_bits(const Tensors& got, const Tensors& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name;
    EXPECT_TRUE(same_bits(got.at(name), t))
        << what << ": " << name << " differs by up to "
        << (got.at(name).to(at::kDouble) - t.to(at::kDouble)).abs().max().item<double>();
  }
}

std::string file_of(const TempDir& dir, int tp) {
  return (dir.path() / ("tp" + std::to_string(tp) + ".safetensors")).string();
}

TEST(LayoutInvariantMode, ARowParallelProductHasTheSameBitsAtTp1Tp2AndTp4) {
  TempDir dir;
  for (int tp : {1, 2, 4}) {
    run_ranks(tp, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {tp});
      at::manual_seed(0);
      const at::Tensor a = at::randn({16, 2048}), b = at::randn({2048, 64}), bias = at::randn({64});
      const auto da = distribute_tensor(a, mesh, {Shard(1)});
      const auto db = distribute_tensor(b, mesh, {Shard(0)});
      const auto dbias = distribute_tensor(bias, mesh, {Replicate()});
      ops::LayoutInvariantMode invariant(4);
      CommDebugMode comm;
      const at::Tensor mm = at::mm(da, db), addmm = at::addmm(dbias, da, db);
      // The sum comes out whole: Replicate, one all_gather per product (none over one rank).
      EXPECT_TRUE(placements(mm)[0].is_replicate());
      EXPECT_TRUE(placements(addmm)[0].is_replicate());
      EXPECT_EQ(comm.get_comm_counts(),
                tp == 1 ? CommCounts{} : CommCounts({{CommType::all_gather_into_tensor, 2}}))
          << comm.table();
      if (rank == 0)
        safetensors::save_file({{"mm", to_local(mm)}, {"addmm", to_local(addmm)}},
                               file_of(dir, tp));
    });
  }
  const Tensors one = safetensors::load_file(file_of(dir, 1));
  expect_same_bits(safetensors::load_file(file_of(dir, 2)), one, "tp=2");
  expect_same_bits(safetensors::load_file(file_of(dir, 4)), one, "tp=4");
}

// Sums and vector norms over a sharded dim (with other dims, keepdim, a dtype argument): the
// result is whole (Replicate) and has the same bits at every degree.
TEST(LayoutInvariantMode, SumsAndNormsOverAShardedDimHaveTheSameBitsAtTp1Tp2AndTp4) {
  TempDir dir;
  for (int tp : {1, 2, 4}) {
    run_ranks(tp, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {tp});
      at::manual_seed(0);
      const auto x = distribute_tensor(at::randn({6, 1024, 5}), mesh, {Shard(1)});
      ops::LayoutInvariantMode invariant(4);
      const Tensors out = {
          {"sum", at::sum(x)},
          {"sum_dims", at::sum(x, {0, 1}, /*keepdim=*/true)},
          {"norm2", at::linalg_vector_norm(x, 2)},
          {"norm3_dims", at::linalg_vector_norm(x, 3, {1}, /*keepdim=*/false)},
          {"norm_f64", at::linalg_vector_norm(x, 2, std::nullopt, false, at::kDouble)}};
      for (const auto& [name, t] : out) EXPECT_TRUE(placements(t)[0].is_replicate()) << name;
      EXPECT_EQ(to_local(out.at("norm_f64")).scalar_type(), at::kDouble);
      Tensors local;
      for (const auto& [name, t] : out) local[name] = to_local(t);
      if (rank == 0) safetensors::save_file(local, file_of(dir, tp));
    });
  }
  const Tensors one = safetensors::load_file(file_of(dir, 1));
  expect_same_bits(safetensors::load_file(file_of(dir, 2)), one, "tp=2");
  expect_same_bits(safetensors::load_file(file_of(dir, 4)), one, "tp=4");
}

TEST(LayoutInvariantMode, RefusesADegreeThatDoesNotDivideTheSegments) {
  EXPECT_CONTAINS(message_of([] { ops::LayoutInvariantMode bad(3); }), "power of two");
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    const auto da = distribute_tensor(at::ones({2, 8}), mesh, {Shard(1)});
    const auto db = distribute_tensor(at::ones({8, 2}), mesh, {Shard(0)});
    ops::LayoutInvariantMode invariant(2);
    EXPECT_CONTAINS(message_of([&] { at::mm(da, db); }), "does not divide max_degree 2");
  });
}

// The tiny preset widened to 64 with 4 KV heads, parallelized with `plan` on a 1-D mesh of `tp`
// ranks. At TP 4 every column shard is 16 wide or more: narrower ones take this LibTorch's
// small-matrix path, whose columns differ from the same columns of a wider product
// (bench_kernel_invariance), and replicated KV projections' gradient sums are not covered yet.
models::Transformer invariant_test_model(int tp, const models::TensorParallelOptions& plan) {
  models::DecoderConfig config = models::DecoderConfig::preset("tiny");
  config.dim = 64;
  config.n_kv_heads = 4;
  config.max_seq_len = 80;  // generation: 64 new tokens after the prompt
  models::Transformer model(config);
  model->init_weights(7);
  models::apply_tensor_parallel(*model, init_device_mesh("cpu", {tp}), plan);
  return model;
}

// Megatron plan (no sequence parallelism, logits gathered).
TEST(LayoutInvariantMode, TransformerLogitsAndGradientsHaveTheSameBitsAtTp1Tp2AndTp4) {
  TempDir dir;
  for (int tp : {1, 2, 4}) {
    run_ranks(tp, [&](int rank) {
      models::Transformer model = invariant_test_model(tp, megatron_plan());
      at::manual_seed(3);
      const at::Tensor tokens = at::randint(model->config().vocab_size, {2, 8});
      Tensors out;
      {
        ops::LayoutInvariantMode invariant(4);
        at::Tensor logits = model->forward(tokens);
        if (is_dtensor(logits)) logits = full_tensor(logits);
        out["logits"] = logits.detach().clone();
        out["loss"] = models::loss_and_backward(logits, tokens);
      }
      for (const auto& p : model->named_parameters()) {
        at::Tensor g = p.value().grad();
        out["grad." + p.key()] = is_dtensor(g) ? full_tensor(g) : g;
      }
      if (rank == 0) safetensors::save_file(out, file_of(dir, tp));
    });
  }
  const Tensors one = safetensors::load_file(file_of(dir, 1));
  expect_same_bits(safetensors::load_file(file_of(dir, 2)), one, "tp=2");
  expect_same_bits(safetensors::load_file(file_of(dir, 4)), one, "tp=4");
}

// torchtitan's plan (sequence parallelism, vocab-parallel loss) with clipping: 5 AdamW steps give
// the same bits at TP 1, 2 and 4 — losses, clipping norms, the last step's gradients and every
// parameter. Sums over a sharded dim (the norms' weight gradients over the sequence, the loss's
// sum over the classes, the gradient norm over each sharded parameter) are the mode's too.
TEST(LayoutInvariantMode, SequenceParallelTrainingWithClippingHasTheSameBitsAtTp1Tp2AndTp4) {
  TempDir dir;
  for (int tp : {1, 2, 4}) {
    run_ranks(tp, [&](int rank) {
      // Sequence parallel, loss parallel.
      models::Transformer model = invariant_test_model(tp, {});
      torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
      at::manual_seed(3);
      const at::Tensor tokens = at::randint(model->config().vocab_size, {2, 8});
      Tensors out;
      std::vector<double> norms;
      for (int step = 0; step < 5; ++step) {
        ops::LayoutInvariantMode invariant(4);
        adamw.zero_grad();
        const at::Tensor logits = model->forward(tokens);
        if (step == 0) out["logits"] = full_tensor(logits).detach().clone();
        out["loss." + std::to_string(step)] = models::loss_and_backward(logits, tokens);
        tp::reduce_partial_grads(*model);
        // Below the gradients' norm (about 2.4 at the first step), so the scaling runs.
        norms.push_back(dtensor::nn::utils::clip_grad_norm_(model->parameters(), 0.5));
        adamw.step();
      }
      out["norms"] = at::tensor(norms, at::kDouble);
      for (const auto& p : model->named_parameters()) {
        const at::Tensor g = p.value().grad();
        out["grad." + p.key()] = is_dtensor(g) ? full_tensor(g) : g;
        out["param." + p.key()] =
            is_dtensor(p.value()) ? full_tensor(p.value()).detach() : p.value().detach();
      }
      if (rank == 0) safetensors::save_file(out, file_of(dir, tp));
    });
  }
  const Tensors one = safetensors::load_file(file_of(dir, 1));
  EXPECT_GT(one.at("norms")[0].item<double>(), 0.5);
  expect_same_bits(safetensors::load_file(file_of(dir, 2)), one, "tp=2");
  expect_same_bits(safetensors::load_file(file_of(dir, 4)), one, "tp=4");
}

// The vocab-parallel loss with label smoothing (its smoothing term sums the log-probabilities
// over the sharded classes): all mass smoothed, per row (where the term's bits show: smoothing
// 0.1 scales them below the loss's last bit), and 0.1 with class weights, the mean.
TEST(LayoutInvariantMode, LabelSmoothedVocabParallelLossHasTheSameBitsAtTp1Tp2AndTp4) {
  namespace F = torch::nn::functional;
  TempDir dir;
  for (int tp : {1, 2, 4}) {
    run_ranks(tp, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {tp});
      at::manual_seed(5);
      const at::Tensor x = at::randn({6, 200}) * 3;
      const at::Tensor target = at::randint(200, {6}, at::kLong);
      const at::Tensor weight = at::rand({200}) + 0.5;
      Tensors out;
      for (bool weighted : {false, true}) {
        const std::string key = weighted ? "weighted." : "plain.";
        auto dx = distribute_tensor(x, mesh, {Shard(1)}).requires_grad_(true);
        auto o = F::CrossEntropyFuncOptions().label_smoothing(weighted ? 0.1 : 1.0);
        if (weighted) o.weight(distribute_tensor(weight, mesh, {Replicate()}));
        if (!weighted) o.reduction(torch::kNone);
        ops::LayoutInvariantMode invariant(4);
        tp::LossParallel loss_parallel;
        const at::Tensor loss =
            F::cross_entropy(dx, distribute_tensor(target, mesh, {Replicate()}), o);
        loss.backward(weighted ? at::Tensor() : at::ones_like(loss));
        out[key + "loss"] = full_tensor(loss.detach());
        out[key + "grad"] = full_tensor(dx.grad());
      }
      if (rank == 0) safetensors::save_file(out, file_of(dir, tp));
    });
  }
  const Tensors one = safetensors::load_file(file_of(dir, 1));
  expect_same_bits(safetensors::load_file(file_of(dir, 2)), one, "tp=2");
  expect_same_bits(safetensors::load_file(file_of(dir, 4)), one, "tp=4");
}

// The mode's gradient norm cuts each gradient into a fixed grid of blocks (dim 0 into 2P): a
// gradient that does not divide into it is refused, naming its shape, on every layout alike.
TEST(LayoutInvariantMode, ClippingRefusesAGradientThatDoesNotSplitIntoItsBlocks) {
  run_ranks(1, [](int) {
    at::Tensor p = at::zeros({6}).requires_grad_(true);
    p.mutable_grad() = at::ones({6});
    ops::LayoutInvariantMode invariant(4);
    EXPECT_CONTAINS(
        message_of([&] { dtensor::nn::utils::clip_grad_norm_({p}, 1.0); }),
        "a gradient of shape [6] does not split into the mode's blocks (8 along dim 0)");
    at::Tensor q = at::zeros({8, 4}).requires_grad_(true);
    q.mutable_grad() = at::full({8, 4}, 0.5);
    EXPECT_EQ(dtensor::nn::utils::clip_grad_norm_({q}, 100.0),
              std::sqrt(8.0));  // 32 squares of 0.5
  });
}

// Pipeline stages: each stage's per-gradient sums are added in the whole model's order, as one
// device adds them, not as two stage totals. Squared sums 1, then sixteen of 2^-54: one device's
// running sum stays 1 (each 2^-54 is below half an ulp of 1), where the second stage's own total
// (2^-50) would make it 1 + 2^-50 and the norm 1 + 2^-51.
TEST(LayoutInvariantMode, ClippingAddsTheStagesSumsInTheWholeModelsOrder) {
  auto grad_with = [](double value) {
    at::Tensor p = at::zeros({8, 4}, at::kDouble).requires_grad_(true);
    at::Tensor g = at::zeros({8, 4}, at::kDouble);
    g[3][1] = value;
    p.mutable_grad() = g;
    return p;
  };
  const double tiny = std::ldexp(1.0, -27);  // its square is 2^-54
  run_ranks(2, [&](int rank) {
    const auto mesh = init_device_mesh("cpu", {2}, {"pp"});
    ops::LayoutInvariantMode invariant(4);
    std::vector<at::Tensor> second_stage;
    for (int k = 0; k < 16; ++k) second_stage.push_back(grad_with(tiny));
    std::vector<at::Tensor> whole = {grad_with(1.0)};
    for (int k = 0; k < 16; ++k) whole.push_back(grad_with(tiny));
    const double one_device = dtensor::nn::utils::clip_grad_norm_(whole, 100.0);
    EXPECT_EQ(one_device, 1.0);
    dtensor::nn::utils::ClipGradNormOptions staged;
    staged.stage_group = mesh.get_group(0);
    const std::vector<at::Tensor> mine =
        rank == 0 ? std::vector<at::Tensor>{grad_with(1.0)} : second_stage;
    EXPECT_EQ(dtensor::nn::utils::clip_grad_norm_(mine, 100.0, staged), one_device);
  });
}

// Generation: the prefill logits, 64 greedy and 64 sampled tokens for three prompts.
TEST(LayoutInvariantMode, GenerationHasTheSameBitsAtTp1Tp2AndTp4) {
  TempDir dir;
  for (int tp : {1, 2, 4}) {
    run_ranks(tp, [&](int rank) {
      models::Transformer model = invariant_test_model(tp, {});
      const std::vector<std::vector<int64_t>> prompts = {{5, 17, 200, 3, 99, 42}, {7}, {120, 1}};
      ops::LayoutInvariantMode invariant(4);
      Tensors out;
      models::GenerateOptions options;
      options.max_new_tokens = 64;
      options.on_logits = [&](const at::Tensor& logits) {
        if (!out.count("prefill")) out["prefill"] = logits.clone();
      };
      auto flat = [](const models::GenerateResult& r) {
        std::vector<int64_t> all;
        for (const auto& row : r.tokens) all.insert(all.end(), row.begin(), row.end());
        return at::tensor(all, at::kLong);
      };
      out["greedy"] = flat(models::generate(*model, prompts, options));
      options.on_logits = nullptr;
      options.temperature = 0.9;
      options.top_k = 40;
      options.seed = 3;
      out["sampled"] = flat(models::generate(*model, prompts, options));
      if (rank == 0) safetensors::save_file(out, file_of(dir, tp));
    });
  }
  const Tensors one = safetensors::load_file(file_of(dir, 1));
  EXPECT_EQ(one.at("greedy").numel(), 3 * 64);
  expect_same_bits(safetensors::load_file(file_of(dir, 2)), one, "tp=2");
  expect_same_bits(safetensors::load_file(file_of(dir, 4)), one, "tp=4");
}

// Generation equals re-running the whole sequence: the logits of each decode step (one position
// against the cache) are the same bits as a fresh generate() of the prompts extended by the
// tokens so far (a prefill, with a cache of another size), two left-padded rows at TP 1 and 2,
// past 64 slots (the mode's attention block).
TEST(LayoutInvariantMode, DecodeStepsEqualPrefillsOfTheWholeSequence) {
  for (int tp : {1, 2}) {
    run_ranks(tp, [&](int) {
      const models::Transformer model = invariant_test_model(tp, {});
      ops::LayoutInvariantMode invariant(4);
      auto run = [&](const std::vector<std::vector<int64_t>>& prompts, int64_t n,
                     std::vector<at::Tensor>& logits) {
        models::GenerateOptions options;
        options.max_new_tokens = n;
        options.on_logits = [&](const at::Tensor& l) { logits.push_back(l.clone()); };
        return models::generate(*model, prompts, options).tokens;
      };
      const std::vector<std::vector<int64_t>> prompts = {{5, 17, 200, 3, 99, 42}, {7, 8}};
      std::vector<at::Tensor> decoded;
      const auto tokens = run(prompts, 70, decoded);
      ASSERT_EQ(decoded.size(), 70u);
      for (size_t k = 1; k < decoded.size(); ++k) {
        std::vector<std::vector<int64_t>> extended = prompts;
        for (size_t b = 0; b < extended.size(); ++b)
          extended[b].insert(extended[b].end(), tokens[b].begin(), tokens[b].begin() + k);
        std::vector<at::Tensor> rerun;
        run(extended, 1, rerun);
        EXPECT_EQ(std::memcmp(rerun[0].const_data_ptr(), decoded[k].const_data_ptr(),
                              decoded[k].nbytes()),
                  0)
            << "tp " << tp << ", decode step " << k << ": max difference "
            << (rerun[0] - decoded[k]).abs().max().item<double>();
      }
    });
  }
}

}  // namespace
