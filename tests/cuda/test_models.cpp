// The Llama model on CUDA: a tensor-parallel training step and generation equal to the same
// model on one GPU, and FSDP mixed precision (bfloat16 compute, float32 shards) near the float32
// run, at 1 rank over NCCL and at 2 ranks sharing the one GPU over Gloo. Skipped where no GPU is
// visible; scripts/gpu-check runs them on a GPU machine.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/models/generate.h"
#include "dtensor/models/transformer.h"
#include "support/cuda.h"
#include "support/distributed.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

DecoderConfig tiny() {
  auto c = DecoderConfig::preset("tiny");
  c.vocab_size = 64;
  c.n_kv_heads = 2;
  return c;
}

// Weights drawn on the CPU (init_weights' generator), then moved: the same model everywhere.
Transformer cuda_model(const DecoderConfig& config, at::ScalarType dtype) {
  Transformer m(config);
  m->init_weights(11);
  m->to(at::kCUDA, dtype);
  return m;
}

struct Precision {
  at::ScalarType dtype;
  double tol;  // close_to_scale tolerance of losses, gradients and parameters
};

// float32: the TP model sums its matmuls' partial products in another order (1e-6 relative),
// which AdamW turns into parameter differences of a few 1e-6. bfloat16 rounds every op to 2^-9
// relative and AdamW moves a weight by up to lr when a tiny gradient flips sign.
const Precision kPrecisions[] = {{at::kFloat, 1e-4}, {at::kBFloat16, 5e-2}};

}  // namespace

// Three AdamW steps of the tiny Llama with sequence and loss parallelism: loss, every gradient
// and every parameter equal the one-GPU model's after each step.
TEST(CudaModels, LlamaTensorParallelTrainingMatchesOneGpu) {
  SKIP_WITHOUT_CUDA();
  for (const auto& s : cuda_settings()) {
    run_cuda_ranks(s, [&](int) {
      auto mesh = init_device_mesh("cuda", {s.world_size});
      for (const auto& p : kPrecisions) {
        SCOPED_TRACE(p.dtype == at::kFloat ? "float32" : "bfloat16");
        const auto config = tiny();
        Transformer ref = cuda_model(config, p.dtype), model = cuda_model(config, p.dtype);
        apply_tensor_parallel(*model, mesh, {.sequence_parallel = true, .loss_parallel = true});
        const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
        torch::optim::AdamW ref_opt(ref->parameters(), opt), tp_opt(model->parameters(), opt);
        const auto ref_params = params_of(*ref), tp_params = params_of(*model);
        ASSERT_EQ(ref_params.size(), tp_params.size());
        for (int step = 0; step < 3; ++step) {
          SCOPED_TRACE("step " + std::to_string(step));
          const auto tokens = at::randint(config.vocab_size, {2, 8}, at::kLong).to(at::kCUDA);
          const auto targets = at::randint(config.vocab_size, {2, 8}, at::kLong).to(at::kCUDA);
          ref_opt.zero_grad();
          tp_opt.zero_grad();
          auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
          auto loss = loss_and_backward(model->forward(tokens), targets);
          reduce_partial_grads(*model);
          EXPECT_TRUE(whole(loss).is_cuda());
          EXPECT_TRUE(close_to_scale(whole(loss), ref_loss, p.tol)) << "loss";
          for (const auto& [name, param] : tp_params) {
            SCOPED_TRACE(name);
            ASSERT_TRUE(param.grad().defined());
            EXPECT_TRUE(close_to_scale(whole(param.grad()), ref_params.at(name).grad(), p.tol))
                << "gradient";
          }
          ref_opt.step();
          tp_opt.step();
          for (const auto& [name, param] : tp_params) {
            SCOPED_TRACE(name);
            EXPECT_TRUE(close_to_scale(whole(param), ref_params.at(name), p.tol)) << "parameter";
          }
        }
      }
    });
  }
}

// Greedy generation with the KV cache on the TP model: the same tokens as the one-GPU model
// (float32; logits to 1e-4 of their scale).
TEST(CudaModels, LlamaTensorParallelGenerationMatchesOneGpu) {
  SKIP_WITHOUT_CUDA();
  for (const auto& s : cuda_settings()) {
    run_cuda_ranks(s, [&](int) {
      auto mesh = init_device_mesh("cuda", {s.world_size});
      const auto config = tiny();
      Transformer ref = cuda_model(config, at::kFloat), model = cuda_model(config, at::kFloat);
      apply_tensor_parallel(*model, mesh, {});
      const std::vector<std::vector<int64_t>> prompts = {{5, 17, 40, 3, 9}, {7}, {12, 1, 2, 63}};
      GenerateOptions o;
      o.max_new_tokens = 8;
      std::vector<at::Tensor> ref_logits, tp_logits;
      o.on_logits = [&](const at::Tensor& l) { ref_logits.push_back(l.detach().cpu()); };
      const auto expected = generate(*ref, prompts, o);
      o.on_logits = [&](const at::Tensor& l) { tp_logits.push_back(whole(l).detach().cpu()); };
      const auto got = generate(*model, prompts, o);
      EXPECT_EQ(got.tokens, expected.tokens);
      ASSERT_EQ(tp_logits.size(), ref_logits.size());
      for (size_t i = 0; i < ref_logits.size(); ++i) {
        EXPECT_TRUE(close_to_scale(tp_logits[i], ref_logits[i], 1e-4)) << "forward " << i;
      }
    });
  }
}

// FSDP2's mixed precision on CUDA: bfloat16 parameters for compute, float32 shards, gradients
// and AdamW state; the losses of three steps within 1% of the float32 run's.
TEST(CudaModels, FsdpMixedPrecisionBf16StaysNearFloat32) {
  SKIP_WITHOUT_CUDA();
  for (const auto& s : cuda_settings()) {
    run_cuda_ranks(s, [&](int) {
      auto mesh = init_device_mesh("cuda", {s.world_size}, {"dp"});
      const int64_t rank = mesh.get_local_rank();
      auto run = [&](fsdp::FullyShardOptions opts) {
        const auto config = tiny();
        Transformer model = cuda_model(config, at::kFloat);
        for (TransformerBlockImpl* block : model->blocks()) fsdp::fully_shard(*block, mesh, opts);
        fsdp::fully_shard(*model, mesh, opts);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
        std::vector<double> losses;
        at::manual_seed(5);  // the same batches in both runs
        for (int step = 0; step < 3; ++step) {
          const auto tokens = at::randint(config.vocab_size, {4, 16}, at::kLong).to(at::kCUDA);
          const auto targets = at::randint(config.vocab_size, {4, 16}, at::kLong).to(at::kCUDA);
          opt.zero_grad();
          const int64_t b = 4 / mesh.size();
          auto logits = model->forward(tokens.narrow(0, b * rank, b));
          auto loss = loss_and_backward(logits.to(at::kFloat), targets.narrow(0, b * rank, b));
          losses.push_back(
              comm::all_reduce(loss.detach(), ReduceOp::Sum, mesh.group(0)).item<double>() /
              static_cast<double>(mesh.size()));
          opt.step();
        }
        for (const auto& [name, p] : params_of(*model)) {
          EXPECT_TRUE(p.is_cuda()) << name;
          EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
          EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << name;
        }
        return losses;
      };
      const auto fp32 = run({.reshard_after_forward = true});
      const auto bf16 = run({.reshard_after_forward = true,
                             .param_dtype = at::kBFloat16,
                             .reduce_dtype = at::kFloat});
      ASSERT_EQ(fp32.size(), bf16.size());
      for (size_t i = 0; i < fp32.size(); ++i) {
        EXPECT_NEAR(bf16[i], fp32[i], 1e-2 * fp32[i]) << "step " << i;
      }
    });
  }
}
