// parallelize_module (the cases of PyTorch's test_parallelize_api.py): plans by path with wildcards
// and nesting, the root key, unmatched keys (warned), src_data_rank, the current mesh; training
// parity with one device; refusals (N-D mesh, two sharding styles on one module) and the rollback
// that leaves a model untouched when a style fails part-way.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/optim/sgd.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

constexpr double kTol = 1e-10;

// PyTorch's MLPModule: net1 = Linear(10, 16), relu, net2 = Linear(16, 10).
struct MLPImpl : dtensor::nn::Module {
  MLPImpl() {
    net1 = register_module("net1", dtensor::nn::Linear(10, 16));
    relu = register_module("relu", torch::nn::ReLU());
    net2 = register_module("net2", dtensor::nn::Linear(16, 10));
  }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& t) { return net2(relu(net1(t))); }, x);
  }
  dtensor::nn::Linear net1{nullptr}, net2{nullptr};
  torch::nn::ReLU relu{nullptr};
};
TORCH_MODULE(MLP);

// {"dummy_encoder": MLP}.
struct EncoderImpl : dtensor::nn::Module {
  EncoderImpl() { dummy_encoder = register_module("dummy_encoder", MLP()); }
  at::Tensor forward(const at::Tensor& x) { return dummy_encoder(x); }
  MLP dummy_encoder{nullptr};
};
TORCH_MODULE(Encoder);

// PyTorch's MLPStacked: layers = ModuleList of MLPs.
struct MLPStackedImpl : dtensor::nn::Module {
  explicit MLPStackedImpl(int n) {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < n; ++i) layers->push_back(MLP());
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = x;
    for (const auto& layer : *layers) y = layer->as<MLPImpl>()->forward(y);
    return y;
  }
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(MLPStacked);

struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
};
template <class M, class... Args>
Model make(int seed, Args... args) {
  at::manual_seed(seed);
  M m(args...);
  m->to(at::kDouble);
  return {m.ptr(), [m](const at::Tensor& x) mutable { return m->forward(x); }};
}

// Runs forward, backward and one SGD(lr 0.25) step on a single-device copy and on the
// parallelized one, comparing outputs, every gradient and every parameter after the step.
// `local_input` maps the global input to what this rank feeds.
void compare_module(const Model& ref, const Model& dist, const at::Tensor& x,
                    const std::function<at::Tensor(const at::Tensor&)>& local_input = nullptr,
                    const std::function<at::Tensor(const at::Tensor&)>& global_output = nullptr) {
  torch::optim::SGD ref_opt(ref.module->parameters(), torch::optim::SGDOptions(0.25));
  torch::optim::SGD dist_opt(dist.module->parameters(), torch::optim::SGDOptions(0.25));
  auto yr = ref.forward(x);
  auto yd = dist.forward(local_input ? local_input(x) : x);
  EXPECT_TENSOR_CLOSE(global_output ? global_output(yd) : yd, yr, kTol, kTol);
  yr.sum().backward();
  yd.sum().backward();
  auto dist_params = dist.module->named_parameters();
  for (const auto& p : ref.module->named_parameters()) {
    SCOPED_TRACE("gradient of " + p.key());
    const at::Tensor& d = dist_params[p.key()];
    ASSERT_TRUE(d.grad().defined());
    EXPECT_TENSOR_CLOSE(is_dtensor(d) ? full_tensor(d.grad()) : d.grad(), p.value().grad(), kTol,
                        kTol);
  }
  ref_opt.step();
  dist_opt.step();
  for (const auto& p : ref.module->named_parameters()) {
    SCOPED_TRACE("parameter " + p.key() + " after SGD");
    const at::Tensor d = dist_params[p.key()].detach();
    EXPECT_TENSOR_CLOSE(is_dtensor(d) ? full_tensor(d) : d, p.value().detach(), kTol, kTol);
  }
}

// Collects TORCH_WARN messages while alive.
class WarningCapture : public c10::WarningHandler {
 public:
  WarningCapture() : guard_(this) {}
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};

tp::Style colwise_replicated_output() {
  return tp::ColwiseParallel({.output_layouts = Replicate()});
}

// A style that swaps a parameter and adds a hook, then fails: the rollback must undo both.
class FailingStyle : public tp::ParallelStyle {
 public:
  std::string repr() const override { return "FailingStyle()"; }
  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override {
    auto* hooked = dynamic_cast<tp::HookedModule*>(&module);
    hooked->register_forward_pre_hook([](torch::nn::Module&, tp::ModuleCall&) {});
    for (const auto& p : module.named_parameters(/*recurse=*/false))
      replace_parameter(module, p.key(), p.value().detach() * 2);
    TORCH_CHECK(false, "FailingStyle fails on purpose");
  }
};

}  // namespace

// Both Linears colwise with replicated outputs; net2 is uneven (10 features, 4 ranks). Nested
// paths, wildcards, and a rowwise Linear fed column chunks.
TEST(ParallelizeModule, PlansByPathAndWildcardMatchOneDeviceThroughSgd) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    auto x = at::rand({12, 10}, at::kDouble);
    {
      SCOPED_TRACE("dict plan, colwise net1/net2 with Replicate outputs (uneven net2)");
      Model ref = make<MLP>(5), dist = make<MLP>(5);
      tp::parallelize_module(*dist.module, mesh,
                             tp::ParallelizePlan{{"net1", colwise_replicated_output()},
                                                 {"net2", colwise_replicated_output()}});
      auto* mlp = dist.module->as<MLPImpl>();
      EXPECT_EQ(local_tensor(mlp->net2->weight).size(0), rank < 3 ? 3 : 1);
      compare_module(ref, dist, x);
    }
    for (const std::string key : {"net*", "net?", "net[1-2]"}) {
      SCOPED_TRACE("wildcard " + key);
      Model ref = make<MLP>(5), dist = make<MLP>(5);
      tp::parallelize_module(*dist.module, mesh,
                             tp::ParallelizePlan{{key, colwise_replicated_output()}});
      auto* mlp = dist.module->as<MLPImpl>();
      EXPECT_TRUE(is_dtensor(mlp->net1->weight));
      EXPECT_TRUE(is_dtensor(mlp->net2->weight));
      compare_module(ref, dist, x);
    }
    {
      SCOPED_TRACE("nested dummy_encoder.net1 / dummy_encoder.net2, Megatron pair");
      Model ref = make<Encoder>(5), dist = make<Encoder>(5);
      tp::parallelize_module(*dist.module, mesh,
                             tp::ParallelizePlan{{"dummy_encoder.net1", tp::ColwiseParallel()},
                                                 {"dummy_encoder.net2", tp::RowwiseParallel()}});
      CommDebugMode comm;
      dist.forward(x);
      EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 1}})) << comm.table();
      comm.exit();
      compare_module(ref, dist, x);
    }
    {
      SCOPED_TRACE("layers.*.net[1] colwise, layers.*.net[2] rowwise");
      Model ref = make<MLPStacked>(5, 2), dist = make<MLPStacked>(5, 2);
      tp::parallelize_module(*dist.module, mesh,
                             tp::ParallelizePlan{{"layers.*.net[1]", tp::ColwiseParallel()},
                                                 {"layers.*.net[2]", tp::RowwiseParallel()}});
      auto* stacked = dist.module->as<MLPStackedImpl>();
      for (int i = 0; i < 2; ++i) {
        auto* layer = stacked->layers[i]->as<MLPImpl>();
        EXPECT_EQ(placements(layer->net1->weight)[0], Shard(0));
        EXPECT_EQ(placements(layer->net2->weight)[0], Shard(1));
        EXPECT_EQ(layer->net2->fqn(),
                  "layers." + std::to_string(i) + ".net2");  // named for CommDebugMode
      }
      compare_module(ref, dist, x);
    }
    {
      SCOPED_TRACE("rowwise Linear(16, 10), each rank feeding its column chunk of (9, 16)");
      Model ref = make<dtensor::nn::Linear>(5, 16, 10), dist = make<dtensor::nn::Linear>(5, 16, 10);
      tp::parallelize_module(*dist.module, mesh, tp::RowwiseParallel());
      compare_module(ref, dist, at::rand({9, 16}, at::kDouble),
                     [rank](const at::Tensor& t) { return t.chunk(4, 1)[rank]; });
    }
  });
}

// The root key "" and keys that match nothing.
TEST(ParallelizeModule, RootKeyAppliesToTheModuleAndUnmatchedKeysWarn) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    auto x = at::rand({16, 10}, at::kDouble);
    {
      SCOPED_TRACE("root PrepareModuleInputOutput around a sequence-parallel MLP");
      Model ref = make<MLP>(5), dist = make<MLP>(5);
      tp::parallelize_module(
          *dist.module, mesh,
          tp::ParallelizePlan{
              {"", tp::PrepareModuleInputOutput({.input_layouts = tp::Layouts{Replicate()},
                                                 .desired_input_layouts = tp::Layouts{Shard(0)},
                                                 .use_local_input = true,
                                                 .output_layouts = {Shard(0)},
                                                 .desired_output_layouts = {Replicate()}})},
              {"net1", tp::ColwiseParallel({.input_layouts = Shard(0)})},
              {"net2", tp::RowwiseParallel({.output_layouts = Shard(0)})}});
      CommDebugMode comm;
      auto y = dist.forward(x);
      // net1 gathers the rows, net2 reduce-scatters them, the root gathers the output.
      EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_gather_into_tensor, 2},
                                                    {CommType::reduce_scatter_tensor, 1}}))
          << comm.table();
      comm.exit();
      EXPECT_FALSE(is_dtensor(y));
      compare_module(ref, dist, x);
    }
    {
      SCOPED_TRACE("unmatched keys warn and the rest still applies");
      Model ref = make<MLP>(5), dist = make<MLP>(5);
      WarningCapture warnings;
      tp::parallelize_module(*dist.module, mesh,
                             tp::ParallelizePlan{{"net0.hello.world", tp::ColwiseParallel()},
                                                 {"net1", tp::ColwiseParallel()},
                                                 {"net2", tp::RowwiseParallel()},
                                                 {"net3", tp::ColwiseParallel()}});
      ASSERT_EQ(warnings.messages.size(), 2u);
      EXPECT_CONTAINS(warnings.messages[0],
                      "Parallelize plan key 'net0.hello.world' could not be resolved: no submodule "
                      "matching token 'net0' in module the root module (");
      EXPECT_CONTAINS(warnings.messages[0], "skipping this plan entry.");
      EXPECT_CONTAINS(warnings.messages[1],
                      "Parallelize plan key 'net3' could not be resolved: no submodule matching "
                      "token 'net3'");
      compare_module(ref, dist, x);
    }
    {
      SCOPED_TRACE("a wildcard branch that fails deeper warns once per branch");
      Model dist = make<MLPStacked>(5, 2);
      WarningCapture warnings;
      tp::parallelize_module(*dist.module, mesh,
                             tp::ParallelizePlan{{"layers.*.net3", tp::ColwiseParallel()}});
      ASSERT_EQ(warnings.messages.size(), 2u);
      EXPECT_CONTAINS(warnings.messages[1], "token 'net3' in module module 'layers.1'");
    }
    (void)rank;
  });
}

// Where parameters come from.
TEST(ParallelizeModule, SrcDataRankPicksTheSourceOrKeepsLocalValuesWithoutMovingThem) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    const tp::ParallelizePlan plan{{"net1", tp::ColwiseParallel()},
                                   {"net2", tp::RowwiseParallel()}};
    for (std::optional<int64_t> src :
         {std::optional<int64_t>(1), std::optional<int64_t>(0), std::optional<int64_t>()}) {
      SCOPED_TRACE(src ? "src_data_rank=" + std::to_string(*src) : "src_data_rank=None");
      Model mine = make<MLP>(100 + rank);  // different values on every rank
      auto originals = mine.module->named_parameters();
      std::map<std::string, at::Tensor> own;
      for (const auto& p : originals) own[p.key()] = p.value().detach().clone();
      CommDebugMode comm;
      tp::parallelize_module(*mine.module, mesh, plan, src);
      comm.exit();
      if (src) {
        // The plan check's all_gather (1); Shard(0)/Shard(1) parameters are scattered (3), the
        // rowwise bias broadcast (1).
        EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_gather_into_tensor, 1},
                                                      {CommType::scatter, 3},
                                                      {CommType::broadcast, 1}}))
            << comm.table();
        Model source = make<MLP>(100 + static_cast<int>(*src));
        for (const auto& p : source.module->named_parameters()) {
          SCOPED_TRACE(p.key());
          EXPECT_TENSOR_EQ(full_tensor(mine.module->named_parameters()[p.key()].detach()),
                           p.value().detach());
        }
      } else {
        // Only the plan check's all_gather: the parameters are not moved.
        EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_gather_into_tensor, 1}}))
            << comm.table();
        auto* mlp = mine.module->as<MLPImpl>();
        EXPECT_TENSOR_EQ(local_tensor(mlp->net1->weight), own["net1.weight"].chunk(4, 0)[rank]);
        EXPECT_TENSOR_EQ(local_tensor(mlp->net2->weight), own["net2.weight"].chunk(4, 1)[rank]);
        EXPECT_TENSOR_EQ(local_tensor(mlp->net2->bias), own["net2.bias"]);
      }
    }
  });
}

// The mesh from a MeshGuard, and no plan at all.
TEST(ParallelizeModule, CurrentMeshAndMissingPlan) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    {
      MeshGuard guard(mesh);
      Model ref = make<dtensor::nn::Linear>(5, 8, 6), dist = make<dtensor::nn::Linear>(5, 8, 6);
      tp::parallelize_module(*dist.module, tp::ColwiseParallel({.output_layouts = Replicate()}));
      compare_module(ref, dist, at::rand({3, 8}, at::kDouble));
      Model plan_ref = make<MLP>(5), plan_dist = make<MLP>(5);
      tp::parallelize_module(
          *plan_dist.module,
          tp::ParallelizePlan{{"net1", tp::ColwiseParallel()}, {"net2", tp::RowwiseParallel()}});
      compare_module(plan_ref, plan_dist, at::rand({3, 10}, at::kDouble));
    }
    dtensor::nn::Linear no_mesh_fc(4, 4);
    EXPECT_ERROR(tp::parallelize_module(*no_mesh_fc, tp::ColwiseParallel()), c10::Error,
                 "no current mesh");
    Model m = make<MLP>(5);
    const at::Tensor before = m.module->as<MLPImpl>()->net1->weight;
    WarningCapture warnings;
    torch::nn::Module& same = tp::parallelize_module(*m.module, mesh);
    EXPECT_EQ(&same, m.module.get());
    ASSERT_EQ(warnings.messages.size(), 1u);
    EXPECT_CONTAINS(warnings.messages[0],
                    "No parallelize_plan is provided and auto-parallel is not supported at the "
                    "moment, so this parallelize_module call will do nothing.");
    EXPECT_TRUE(m.module->as<MLPImpl>()->net1->weight.is_same(before));
    (void)rank;
  });
}

// Refusals, all before anything changes, and the rollback when a style fails while applying.
TEST(ParallelizeModule, RefusalsAndRollbackLeaveTheModelUntouched) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    // What a model looks like before: parameter objects and values, hooks, marks.
    struct State {
      std::vector<at::Tensor> params, values;
      size_t hooks = 0;
    };
    auto state_of = [](torch::nn::Module& root) {
      State s;
      for (const auto& p : root.named_parameters()) {
        s.params.push_back(p.value());
        s.values.push_back(p.value().detach().clone());
      }
      for (const auto& m : root.modules())
        if (auto* h = dynamic_cast<tp::HookedModule*>(m.get())) s.hooks += h->num_hooks();
      return s;
    };
    auto expect_untouched = [&](torch::nn::Module& root, const State& before) {
      const State now = state_of(root);
      ASSERT_EQ(now.params.size(), before.params.size());
      for (size_t i = 0; i < now.params.size(); ++i) {
        EXPECT_TRUE(now.params[i].is_same(before.params[i])) << "parameter " << i << " swapped";
        EXPECT_FALSE(is_dtensor(now.params[i]));
        EXPECT_TRUE(now.params[i].requires_grad());
        EXPECT_TENSOR_EQ(now.params[i].detach(), before.values[i]);
      }
      EXPECT_EQ(now.hooks, 0u);
    };
    {
      SCOPED_TRACE("N-D mesh");
      auto mesh2d = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
      MLP m;
      const State before = state_of(*m);
      EXPECT_ERROR(
          tp::parallelize_module(*m, mesh2d, tp::ParallelizePlan{{"net1", tp::ColwiseParallel()}}),
          c10::Error, "Tensor Parallel only accepts a 1D DeviceMesh, but found 2D!",
          "consider passing in device_mesh[\"tp\"]");
      expect_untouched(*m, before);
      // The tp slice works.
      tp::parallelize_module(*m, mesh2d["tp"],
                             tp::ParallelizePlan{{"net1", tp::ColwiseParallel()}});
      EXPECT_EQ(device_mesh(m->net1->weight).size(), 2);
    }
    {
      SCOPED_TRACE("two parameter-sharding styles on one module");
      MLP m;
      const State before = state_of(*m);
      EXPECT_ERROR(tp::parallelize_module(*m, mesh,
                                          tp::ParallelizePlan{{"net1", tp::ColwiseParallel()},
                                                              {"net2", tp::RowwiseParallel()},
                                                              {"net*", tp::RowwiseParallel()}}),
                   c10::Error, "module 'net1' (dtensor::nn::Linear) two parameter-sharding styles");
      expect_untouched(*m, before);
      // Sharding again after a successful call is refused too.
      tp::parallelize_module(*m, mesh, tp::ParallelizePlan{{"net1", tp::ColwiseParallel()}});
      EXPECT_ERROR(
          tp::parallelize_module(*m, mesh, tp::ParallelizePlan{{"net1", tp::RowwiseParallel()}}),
          c10::Error, "has already been parallelized");
    }
    {
      SCOPED_TRACE("a style failing in apply after others were applied");
      MLP m;
      const State before = state_of(*m);
      EXPECT_ERROR(
          tp::parallelize_module(
              *m, mesh,
              tp::ParallelizePlan{
                  {"net1", tp::ColwiseParallel()},
                  {"net2", tp::RowwiseParallel()},
                  {"", tp::PrepareModuleInput({.input_layouts = tp::Layouts{Shard(0)},
                                               .desired_input_layouts = tp::Layouts{Replicate()}})},
                  {"net2", std::make_shared<FailingStyle>()}}),
          c10::Error, "FailingStyle fails on purpose");
      expect_untouched(*m, before);
      EXPECT_TRUE(m->net1->weight.is_same(m->net1->named_parameters()["weight"]));
      EXPECT_FALSE(is_distributed_module(*m->net1));
      // The model is usable as it was, and can be parallelized afterwards.
      auto x = at::rand({4, 10});
      EXPECT_TENSOR_EQ(m(x), m->net2(at::relu(m->net1(x))));
      Model ref = make<MLP>(5), dist = make<MLP>(5);
      EXPECT_ERROR(
          tp::parallelize_module(*dist.module, mesh,
                                 tp::ParallelizePlan{{"net1", tp::ColwiseParallel()},
                                                     {"net1", std::make_shared<FailingStyle>()}}),
          c10::Error, "FailingStyle fails on purpose");
      tp::parallelize_module(
          *dist.module, mesh,
          tp::ParallelizePlan{{"net1", tp::ColwiseParallel()}, {"net2", tp::RowwiseParallel()}});
      compare_module(ref, dist, at::rand({12, 10}, at::kDouble));
    }
    (void)rank;
  });
}

TEST(ParallelizeModule, FnmatchFollowsPythonRules) {
  using tp::fnmatch;
  EXPECT_TRUE(fnmatch("net*", "net1"));
  EXPECT_TRUE(fnmatch("net*", "net"));
  EXPECT_FALSE(fnmatch("net*", "relu"));
  EXPECT_TRUE(fnmatch("*", ""));
  EXPECT_TRUE(fnmatch("n*t*2", "net_2"));
  EXPECT_FALSE(fnmatch("n*t*2", "net_3"));
  EXPECT_TRUE(fnmatch("net?", "net1"));
  EXPECT_FALSE(fnmatch("net?", "net10"));
  EXPECT_TRUE(fnmatch("net[1-2]", "net2"));
  EXPECT_FALSE(fnmatch("net[1-2]", "net3"));
  EXPECT_TRUE(fnmatch("[!x]", "y"));
  EXPECT_FALSE(fnmatch("[!x]", "x"));
  EXPECT_TRUE(fnmatch("[]]", "]"));
  EXPECT_TRUE(fnmatch("a[", "a["));  // no closing bracket: literal
  EXPECT_TRUE(fnmatch("[0-9][0-9]", "12"));
  EXPECT_FALSE(fnmatch("1", "12"));
  EXPECT_TRUE(fnmatch("*.*", "a.b"));
  EXPECT_FALSE(fnmatch("[a-]", "b"));
  EXPECT_TRUE(fnmatch("[a-]", "-"));
}
