// Tied weights (one tensor registered in two modules) are optimized once: parameters() of a
// dtensor::nn::Module lists a tied tensor once, as PyTorch's does, unique_parameters() does the
// same for any module, and Adam on either matches one device where the weight is stepped once.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>

#include "dtensor/dtensor.h"
#include "dtensor/models/transformer.h"
#include "support/distributed.h"

using namespace dtensor;
using namespace dtensor::testing;
using namespace dtensor::tp;

namespace {

// Embedding and output head sharing one [vocab, dim] weight, as language models tie them.
struct TiedLmImpl : dtensor::nn::Module {
  TiedLmImpl() {
    at::manual_seed(3);
    embedding = register_module("embedding", dtensor::nn::Embedding(16, 8));
    head = register_module("head", dtensor::nn::Linear(8, 16));
    tie();
  }
  void tie() { replace_parameter(*head, "weight", embedding->weight); }
  at::Tensor forward(const at::Tensor& tokens) {
    return call_forward([this](const at::Tensor& t) { return head(embedding(t).tanh()); }, tokens);
  }
  dtensor::nn::Embedding embedding{nullptr};
  dtensor::nn::Linear head{nullptr};
};
TORCH_MODULE(TiedLm);

at::Tensor whole(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t.detach()) : t; }

// One device, written out: Adam over the two distinct tensors, each stepped once.
struct Reference {
  TiedLm model;
  std::unique_ptr<torch::optim::Adam> opt;
  Reference() {
    opt = std::make_unique<torch::optim::Adam>(
        std::vector<at::Tensor>{model->embedding->weight, model->head->bias},
        torch::optim::AdamOptions(0.1));
  }
};

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(whole(logits), targets);
}

}  // namespace

TEST(TiedParameters, ParametersListATiedTensorOnceAndNamedParametersKeepTheFirstName) {
  TiedLm m;
  ASSERT_TRUE(m->head->weight.is_same(m->embedding->weight));
  EXPECT_EQ(m->parameters().size(), 2u);
  const auto named = m->named_parameters();
  EXPECT_EQ(named.keys(), (std::vector<std::string>{"embedding.weight", "head.bias"}));
  // The tie stays visible where PyTorch shows it: in the head's own parameters, and in
  // LibTorch's undeduplicated listing through a torch::nn::Module reference.
  EXPECT_TRUE(m->head->named_parameters(/*recurse=*/false)["weight"].is_same(m->embedding->weight));
  const torch::nn::Module& plain = *m;
  EXPECT_EQ(plain.parameters().size(), 3u);
  EXPECT_EQ(unique_parameters(plain).size(), 2u);
  EXPECT_EQ(unique_named_parameters(plain).keys(), named.keys());
}

TEST(TiedParameters, AdamOnParametersOfATiedTpModelMatchesOneDevice) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    TiedLm model;
    // Both uses shard the vocab rows, so the tie survives as one Shard(0) DTensor.
    parallelize_module(
        *model, mesh,
        ParallelizePlan{{"embedding", RowwiseParallel({.input_layouts = Replicate()})},
                        {"head", ColwiseParallel({.output_layouts = Replicate()})}});
    model->tie();
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.1));
    Reference ref;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      auto tokens = at::randint(16, {4, 5});
      auto targets = at::randint(16, {4 * 5});
      opt.zero_grad();
      ref.opt->zero_grad();
      auto loss = loss_of(model->forward(tokens).reshape({-1, 16}), targets);
      auto ref_loss = loss_of(ref.model->forward(tokens).reshape({-1, 16}), targets);
      EXPECT_TENSOR_CLOSE(loss, ref_loss, 1e-5, 1e-6);
      loss.backward();
      ref_loss.backward();
      opt.step();
      ref.opt->step();
      EXPECT_TENSOR_CLOSE(whole(model->embedding->weight), ref.model->embedding->weight, 1e-5,
                          1e-6);
      EXPECT_TENSOR_CLOSE(whole(model->head->bias), ref.model->head->bias, 1e-5, 1e-6);
    }
  });
}

// The bundled Llama with tied embeddings, under TP: its parameters() (what the trainer and the
// docs hand the optimizer) hold each tensor once.
TEST(TiedParameters, TiedLlamaListsEachTensorOnce) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto c = models::DecoderConfig::preset("tiny");
    c.vocab_size = 64;
    c.tie_embeddings = true;
    models::Transformer model(c);
    models::apply_tensor_parallel(*model, mesh, {});
    const torch::nn::Module& plain = *model;
    EXPECT_EQ(plain.parameters().size(), unique_parameters(plain).size());
    EXPECT_EQ(model->parameters().size(), unique_parameters(plain).size());
    EXPECT_TRUE(model->output->weight.is_same(model->tok_embeddings->weight));
  });
}
