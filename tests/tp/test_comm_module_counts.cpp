// CommDebugMode's per-module counts (docs/ARCHITECTURE.md, "Collective counts"): collectives count
// for the module that issued them and its parents, forward and backward apart; backward collectives
// count for the module whose forward built that part of the graph. The layouts are built by hand
// with forward hooks (the same from_local/redistribute/to_local calls ColwiseParallel and
// RowwiseParallel make), so these tests need no parallel style.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

namespace {

struct MlpImpl : dtensor::nn::Module {
  dtensor::nn::Linear net1{nullptr}, net2{nullptr};
  MlpImpl() {
    at::manual_seed(5);
    net1 = register_module("net1", dtensor::nn::Linear(10, 16));
    net2 = register_module("net2", dtensor::nn::Linear(16, 10));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& x) { return net2(net1(x).relu()); }, x);
  }
};
TORCH_MODULE(Mlp);

struct BlockImpl : dtensor::nn::Module {
  Mlp mlp;
  BlockImpl() { register_module("mlp", mlp); }
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([this](const at::Tensor& x) { return mlp(x); }, x);
  }
};
TORCH_MODULE(Block);

// net1 Colwise (input Replicate, output local Shard(-1)); net2 Rowwise (input Shard(-1),
// output Replicate): 1 all_reduce forward (net2), 1 backward (net1's input). Sequence
// parallel: net1's input is this rank's Shard(0) rows (gathered), net2's output is
// reduce-scattered back to rows.
void megatron(MlpImpl& m, const DeviceMesh& mesh, bool sequence_parallel = false) {
  replace_parameter(*m.net1, "weight",
                    distribute_tensor(m.net1->weight.detach(), mesh, {Shard(0)}));
  replace_parameter(*m.net1, "bias", distribute_tensor(m.net1->bias.detach(), mesh, {Shard(0)}));
  replace_parameter(*m.net2, "weight",
                    distribute_tensor(m.net2->weight.detach(), mesh, {Shard(1)}));
  replace_parameter(*m.net2, "bias", distribute_tensor(m.net2->bias.detach(), mesh, {Replicate()}));
  const Placement in = sequence_parallel ? Placement(Shard(0)) : Placement(Replicate());
  const Placement out = sequence_parallel ? Placement(Shard(0)) : Placement(Replicate());
  m.net1->register_forward_pre_hook([mesh, in](torch::nn::Module&, tp::ModuleCall& c) {
    c.args[0] = redistribute(from_local(c.args[0].toTensor(), mesh, {in}), {Replicate()});
  });
  m.net1->register_forward_hook([](torch::nn::Module&, const tp::ModuleCall&, c10::IValue& o) {
    o = to_local(o.toTensor());
  });
  m.net2->register_forward_pre_hook([mesh](torch::nn::Module&, tp::ModuleCall& c) {
    c.args[0] = from_local(c.args[0].toTensor(), mesh, {Shard(1)});
  });
  m.net2->register_forward_hook([out](torch::nn::Module&, const tp::ModuleCall&, c10::IValue& o) {
    o = to_local(redistribute(o.toTensor(), {out}));
  });
}

const CommCounts kOneAllReduce{{CommType::all_reduce, 1}};

}  // namespace

TEST(CommModuleCounts, BackwardCollectivesCountForTheModuleWhoseForwardBuiltThem) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    Mlp ref, tp;
    megatron(*tp, mesh);
    at::manual_seed(0);
    auto x = at::rand({8, 10}, at::kDouble).requires_grad_();
    auto x_ref = x.detach().clone().requires_grad_();
    ref(x_ref).sum().backward();

    CommDebugMode comm;
    auto out = tp(x);
    out.sum().backward();
    EXPECT_TENSOR_CLOSE(out, ref(x_ref), 1e-12, 1e-12);
    EXPECT_TENSOR_CLOSE(x.grad(), x_ref.grad(), 1e-12, 1e-12);

    auto m = comm.comm_module_counts();
    EXPECT_EQ(m["Global"]["forward"], kOneAllReduce);
    EXPECT_EQ(m["Global"]["backward"], kOneAllReduce);
    EXPECT_EQ(m["net2"]["forward"], kOneAllReduce);  // the output all_reduce
    EXPECT_EQ(m["net2"].count("backward"), 0u);
    EXPECT_EQ(m["net1"]["backward"], kOneAllReduce);  // from_local's backward of its input
    EXPECT_EQ(m["net1"].count("forward"), 0u);
    EXPECT_EQ(m.size(), 3u) << comm.module_table();  // the root's own count is Global's
    for (const auto& r : comm.records()) {
      EXPECT_EQ(r.backward, r.module == "net1") << r.module;
    }
    EXPECT_EQ(comm.modules(), (std::vector<std::string>{"net1", "net2"}));
  });
}

TEST(CommModuleCounts, ParentsIncludeChildrenAndTheTableIndentsByDepth) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    Block block;
    megatron(*block->mlp, mesh);
    // Naming a submodule from itself (as a per-layer parallelize_module call may) does not
    // change the names: the outermost module called names its subtree.
    tp::name_modules(*block->mlp);
    auto x = at::rand({8, 10}, at::kDouble).requires_grad_();
    CommDebugMode comm;
    block(x).sum().backward();
    auto m = comm.comm_module_counts();
    EXPECT_EQ(m["mlp"]["forward"], kOneAllReduce);
    EXPECT_EQ(m["mlp"]["backward"], kOneAllReduce);
    EXPECT_EQ(m["mlp.net1"]["backward"], kOneAllReduce);
    EXPECT_EQ(m["mlp.net2"]["forward"], kOneAllReduce);
    EXPECT_EQ(m.count("net1"), 0u);

    const std::string t = comm.module_table();
    EXPECT_NE(t.find("\nGlobal "), std::string::npos) << t;
    EXPECT_NE(t.find("\n  mlp "), std::string::npos) << t;
    EXPECT_NE(t.find("\n    mlp.net1 "), std::string::npos) << t;
    EXPECT_NE(t.find("\n    mlp.net2 "), std::string::npos) << t;
    // Global row: all_reduce forward 1, backward 1; net1 row: forward none, backward 1.
    auto row = [&](const std::string& name) {
      auto b = t.find("\n" + name + " ");
      return t.substr(b + 1, t.find('\n', b + 1) - b - 1);
    };
    EXPECT_NE(row("Global").find("1     1"), std::string::npos) << t;
    EXPECT_NE(row("    mlp.net1").find("-     1"), std::string::npos) << t;
    EXPECT_NE(row("    mlp.net2").find("1     -"), std::string::npos) << t;
    EXPECT_LT(t.find("mlp.net1"), t.find("mlp.net2")) << t;  // in the order they ran
  });
}

TEST(CommModuleCounts, EveryCollectiveOfABackwardPassIsMarkedBackward) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    Mlp tp;
    // The sequence-parallel layouts: backward collectives run inside redistribute's and
    // from_local's autograd nodes.
    megatron(*tp, mesh, /*sequence_parallel=*/true);
    auto x = at::rand({2, 10}, at::kDouble).requires_grad_();
    CommDebugMode comm;
    auto y = tp(x);
    const int64_t n_forward = comm.get_total_counts();
    y.sum().backward();
    auto records = comm.records();
    ASSERT_GT(records.size(), static_cast<size_t>(n_forward));
    for (size_t i = 0; i < records.size(); ++i) {
      EXPECT_EQ(records[i].backward, static_cast<int64_t>(i) >= n_forward)
          << i << " " << comm_type_name(records[i].type);
    }
  });
}

TEST(CommModuleCounts, ForwardRunWithoutAModeLeavesBackwardCountsToGlobal) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    Mlp tp;
    megatron(*tp, mesh);
    auto x = at::rand({4, 10}, at::kDouble).requires_grad_();
    auto y = tp(x);  // no CommDebugMode: no tracking hooks
    CommDebugMode comm;
    y.sum().backward();
    auto m = comm.comm_module_counts();
    EXPECT_EQ(m["Global"]["backward"], kOneAllReduce);
    EXPECT_EQ(m.size(), 1u) << comm.module_table();
    EXPECT_TRUE(comm.records().at(0).backward);
  });
}
