// Unmodified torch::nn modules with DTensor parameters: outputs, every gradient and the
// parameters after optimizer steps equal the single-device run, for colwise, rowwise and
// replicated layouts (Linear, a Linear-ReLU-Linear MLP, an attention block).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <map>

#include "dtensor/dtensor.h"
#include "support/distributed.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

constexpr double kTol = 1e-10;

// q, k, v and output projections around causal scaled-dot-product attention. The key
// projection has no bias: a key bias adds the same amount to every score of a query, which
// softmax cancels, so its true gradient is zero and Adam would turn the round-off left in it
// into full-size steps that differ between any two summation orders (and CPUs).
struct AttentionBlockImpl : torch::nn::Module {
  AttentionBlockImpl(int64_t dim, int64_t heads) : heads(heads) {
    q = register_module("q", torch::nn::Linear(dim, dim));
    k = register_module("k", torch::nn::Linear(torch::nn::LinearOptions(dim, dim).bias(false)));
    v = register_module("v", torch::nn::Linear(dim, dim));
    o = register_module("o", torch::nn::Linear(dim, dim));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t B = x.size(0), S = x.size(1), D = x.size(2);
    auto split = [&](const at::Tensor& t) {
      return t.view({B, S, heads, D / heads}).transpose(1, 2);
    };
    auto a = at::scaled_dot_product_attention(split(q(x)), split(k(x)), split(v(x)), std::nullopt,
                                              0.0, true);
    return o(a.transpose(1, 2).reshape({B, S, D}));
  }
  int64_t heads;
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
};
TORCH_MODULE(AttentionBlock);

struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
};
using ModelFactory = std::function<Model()>;

Model linear_model(int64_t in, int64_t out, bool bias) {
  torch::nn::Linear m(torch::nn::LinearOptions(in, out).bias(bias));
  m->to(at::kDouble);
  return {m.ptr(), [m](const at::Tensor& x) mutable { return m(x); }};
}

Model mlp_model(int64_t dim, int64_t hidden) {
  torch::nn::Sequential m(torch::nn::Linear(dim, hidden), torch::nn::ReLU(),
                          torch::nn::Linear(hidden, dim));
  m->to(at::kDouble);
  return {m.ptr(), [m](const at::Tensor& x) mutable { return m->forward(x); }};
}

Model attention_model(int64_t dim, int64_t heads) {
  AttentionBlock m(dim, heads);
  m->to(at::kDouble);
  return {m.ptr(), [m](const at::Tensor& x) mutable { return m(x); }};
}

// Placements by parameter name ("0.weight"); parameters not named are replicated.
struct Plan {
  std::string name;
  std::map<std::string, Placements> params;
  Placements input;
};

// Swaps every parameter of `root` for a DTensor laid out as the plan says.
void apply_plan(torch::nn::Module& root, const DeviceMesh& mesh, const Plan& plan) {
  for (const auto& item : root.named_modules()) {
    torch::nn::Module& m = *item.value();
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      const std::string full = item.key().empty() ? p.key() : item.key() + "." + p.key();
      auto it = plan.params.find(full);
      const Placements pl = it == plan.params.end() ? replicate_all(mesh.ndim()) : it->second;
      replace_parameter(m, p.key(), distribute_tensor(p.value().detach(), mesh, pl));
    }
  }
}

enum class Opt { AdamW, SGD };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt kind, std::vector<at::Tensor> params) {
  if (kind == Opt::AdamW) {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

// Trains a copy on one device and a copy with the plan's DTensor parameters for `steps`
// steps on the same data; compares outputs, input and parameter gradients at every step and
// the parameters after the last one.
void compare_training(const DeviceMesh& mesh, const std::string& label, const ModelFactory& factory,
                      const Plan& plan, c10::IntArrayRef input_shape, Opt opt, int steps = 3) {
  SCOPED_TRACE(label + " / " + plan.name + (opt == Opt::AdamW ? " / AdamW" : " / SGD"));
  at::manual_seed(0);
  Model ref = factory();
  at::manual_seed(0);
  Model dist = factory();
  apply_plan(*dist.module, mesh, plan);
  auto ref_params = ref.module->named_parameters();
  auto dist_params = dist.module->named_parameters();
  std::vector<Placements> initial;
  for (const auto& p : dist_params) {
    ASSERT_TRUE(is_dtensor(p.value())) << p.key();
    initial.push_back(placements(p.value()));
  }
  auto ref_opt = make_optimizer(opt, ref.module->parameters());
  auto dist_opt = make_optimizer(opt, dist.module->parameters());
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto x0 = at::randn(input_shape, at::kDouble);
    auto xr = x0.clone().requires_grad_(true);
    auto xd = distribute_tensor(x0, mesh, plan.input).requires_grad_(true);
    ref_opt->zero_grad();
    dist_opt->zero_grad();
    auto yr = ref.forward(xr);
    auto yd = dist.forward(xd);
    const auto w0 = at::randn(yr.sizes(), at::kDouble);
    (yr * w0).sum().backward();
    (yd * distribute_tensor(w0, mesh, replicate_all(mesh.ndim()))).sum().backward();
    EXPECT_TENSOR_CLOSE(full_tensor(yd), yr, kTol, kTol);
    EXPECT_TENSOR_CLOSE(full_tensor(xd.grad()), xr.grad(), kTol, kTol);
    for (const auto& p : ref_params) {
      SCOPED_TRACE("gradient of " + p.key());
      const at::Tensor& g = dist_params[p.key()].grad();
      ASSERT_TRUE(g.defined());
      EXPECT_TENSOR_CLOSE(full_tensor(g), p.value().grad(), kTol, kTol);
    }
    ref_opt->step();
    dist_opt->step();
  }
  size_t i = 0;
  for (const auto& p : ref_params) {
    SCOPED_TRACE("parameter " + p.key() + " after the optimizer");
    const at::Tensor& d = dist_params[p.key()];
    EXPECT_EQ(placements(d), initial[i++]);  // updates keep the parameter's layout
    EXPECT_TENSOR_CLOSE(full_tensor(d.detach()), p.value().detach(), 1e-9, 1e-9);
  }
}

const Placements R{Replicate()}, S0{Shard(0)}, S1{Shard(1)};

// Plans for one Linear called "" (the module itself) taking inputs of `ndim` dims.
std::vector<Plan> linear_plans(int64_t ndim) {
  const Placements last{Shard(ndim - 1)};
  return {
      {"colwise", {{"weight", S0}, {"bias", S0}}, R},
      {"rowwise", {{"weight", S1}, {"bias", R}}, last},
      {"rowwise, replicated input", {{"weight", S1}, {"bias", R}}, R},
      {"replicated", {}, R},
      {"replicated, batch-split input", {}, S0},
  };
}

}  // namespace

TEST(NnModules, LinearMatchesOneDeviceWithEveryLayout) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      int64_t cases = 0;
      for (bool bias : {true, false}) {
        for (const auto& shape : std::vector<std::vector<int64_t>>{{4, 6}, {2, 3, 6}}) {
          for (const auto& plan : linear_plans(static_cast<int64_t>(shape.size()))) {
            for (Opt opt : {Opt::AdamW, Opt::SGD}) {
              compare_training(
                  mesh,
                  std::string("Linear(6, 8") + (bias ? ")" : ", no bias)") + " on " +
                      c10::str(c10::IntArrayRef(shape)),
                  [bias] { return linear_model(6, 8, bias); }, plan, shape, opt);
              ++cases;
            }
          }
        }
      }
      // 2 bias x 2 shapes x 5 plans x 2 optimizers: fewer means linear_plans lost a plan.
      EXPECT_EQ(cases, 2 * 2 * 5 * 2);
      if (rank == 0)
        std::printf("[sweep] nn::Linear training, world %d: %ld (layout, case) combinations\n",
                    world, (long)cases);
    });
  }
}

TEST(NnModules, MlpMatchesOneDevice) {
  const std::vector<Plan> plans = {
      {"megatron (colwise, rowwise)",
       {{"0.weight", S0}, {"0.bias", S0}, {"2.weight", S1}, {"2.bias", R}},
       R},
      {"rowwise, colwise",
       {{"0.weight", S1}, {"0.bias", R}, {"2.weight", S0}, {"2.bias", S0}},
       Placements{Shard(2)}},
      {"replicated", {}, R},
  };
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [&plans, world](int) {
      auto mesh = init_device_mesh("cpu", {world});
      for (const auto& plan : plans) {
        for (Opt opt : {Opt::AdamW, Opt::SGD}) {
          compare_training(
              mesh, "MLP 6-16-6", [] { return mlp_model(6, 16); }, plan, {2, 3, 6}, opt);
        }
      }
    });
  }
}

// Megatron MLP: no collective in forward (the output stays a pending sum), backward, or the
// optimizer step: every gradient already has its parameter's layout.
TEST(NnModules, MegatronMlpCommunicatesOnlyToReadTheOutput) {
  for (int world : {2, 4}) {
    run_ranks(world, [world](int) {
      auto mesh = init_device_mesh("cpu", {world});
      at::manual_seed(0);
      Model m = mlp_model(8, 16);
      apply_plan(
          *m.module, mesh,
          {"megatron", {{"0.weight", S0}, {"0.bias", S0}, {"2.weight", S1}, {"2.bias", R}}, R});
      torch::optim::AdamW opt(m.module->parameters(), torch::optim::AdamWOptions(0.01));
      auto x = distribute_tensor(at::randn({4, 8}, at::kDouble), mesh, {Replicate()});
      auto w = distribute_tensor(at::randn({4, 8}, at::kDouble), mesh, {Replicate()});
      CommDebugMode comm;
      auto y = m.forward(x);
      EXPECT_EQ(comm.get_total_counts(), 0) << "forward\n" << comm.table();
      EXPECT_EQ(placements(y)[0], Partial());
      comm.enter();
      (y * w).sum().backward();
      EXPECT_EQ(comm.get_total_counts(), 0) << "backward\n" << comm.table();
      comm.enter();
      opt.step();
      EXPECT_EQ(comm.get_total_counts(), 0) << "optimizer\n" << comm.table();
      comm.enter();
      full_tensor(y);
      EXPECT_EQ(comm.get_comm_counts()[CommType::all_reduce], 1) << comm.table();
    });
  }
}

TEST(NnModules, AttentionBlockMatchesOneDevice) {
  const std::vector<Plan> plans = {
      {"megatron (qkv colwise, o rowwise)",
       {{"q.weight", S0},
        {"q.bias", S0},
        {"k.weight", S0},
        {"v.weight", S0},
        {"v.bias", S0},
        {"o.weight", S1},
        {"o.bias", R}},
       R},
      {"replicated", {}, R},
      {"replicated, batch-split input", {}, S0},
  };
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [&plans, world](int) {
      auto mesh = init_device_mesh("cpu", {world});
      for (const auto& plan : plans) {
        for (Opt opt : {Opt::AdamW, Opt::SGD}) {
          compare_training(
              mesh, "attention block (dim 8, 4 heads)", [] { return attention_model(8, 4); }, plan,
              {4, 5, 8}, opt);
        }
      }
    });
  }
}

// Megatron attention: heads stay split from the q/k/v projections through attention to the
// output projection; nothing is communicated in forward or backward.
TEST(NnModules, MegatronAttentionBlockNeedsNoCommunication) {
  for (int world : {2, 4}) {
    run_ranks(world, [world](int) {
      auto mesh = init_device_mesh("cpu", {world});
      at::manual_seed(0);
      Model m = attention_model(8, 4);
      apply_plan(*m.module, mesh,
                 {"megatron",
                  {{"q.weight", S0},
                   {"q.bias", S0},
                   {"k.weight", S0},
                   {"v.weight", S0},
                   {"v.bias", S0},
                   {"o.weight", S1},
                   {"o.bias", R}},
                  R});
      auto x = distribute_tensor(at::randn({2, 5, 8}, at::kDouble), mesh, {Replicate()})
                   .requires_grad_(true);
      auto w = distribute_tensor(at::randn({2, 5, 8}, at::kDouble), mesh, {Replicate()});
      CommDebugMode comm;
      auto y = m.forward(x);
      EXPECT_EQ(comm.get_total_counts(), 0) << "forward\n" << comm.table();
      EXPECT_EQ(placements(y)[0], Partial());
      comm.enter();
      (y * w).sum().backward();
      EXPECT_EQ(comm.get_total_counts(), 0) << "backward\n" << comm.table();
      EXPECT_EQ(placements(x.grad())[0], Partial());
    });
  }
}
