// PyTorch's collective counts that need no module hooks: the layouts TP styles produce, built by
// hand with from_local/redistribute/to_local around unmodified torch::nn::Linear.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

namespace {

struct Mlp {
  torch::nn::Linear net1{nullptr}, net2{nullptr};
  Mlp() {
    at::manual_seed(5);
    net1 = torch::nn::Linear(torch::nn::LinearOptions(10, 16));
    net2 = torch::nn::Linear(torch::nn::LinearOptions(16, 10));
    net1->to(at::kDouble);
    net2->to(at::kDouble);
  }
  std::vector<at::Tensor> params() { return {net1->weight, net1->bias, net2->weight, net2->bias}; }
};

void shard(torch::nn::LinearImpl& l, const DeviceMesh& mesh, Placement w, Placement b) {
  replace_parameter(l, "weight", distribute_tensor(l.weight.detach(), mesh, {w}));
  replace_parameter(l, "bias", distribute_tensor(l.bias.detach(), mesh, {b}));
}

}  // namespace

TEST(CommCounts, ColwiseThenRowwiseMlpIssuesOneAllReduceForForwardAndBackward) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    Mlp ref, tp;
    shard(*tp.net1, mesh, Shard(0), Shard(0));     // ColwiseParallel
    shard(*tp.net2, mesh, Shard(1), Replicate());  // RowwiseParallel
    at::manual_seed(0);
    auto x = at::rand({8, 10}, at::kDouble);
    torch::optim::SGD ref_opt(ref.params(), torch::optim::SGDOptions(0.25));
    torch::optim::SGD tp_opt(tp.params(), torch::optim::SGDOptions(0.25));

    auto ref_out = ref.net2(ref.net1(x).relu());
    ref_out.sum().backward();

    CommDebugMode comm;
    auto h = tp.net1(from_local(x, mesh, {Replicate()})).relu();  // colwise input: R
    auto y = tp.net2(h);                                          // rowwise output: Partial
    EXPECT_EQ(placements(h)[0], Shard(1));
    EXPECT_EQ(placements(y)[0], Partial());
    auto out = to_local(redistribute(y, {Replicate()}));
    out.sum().backward();
    EXPECT_EQ(comm.get_comm_counts(), (CommCounts{{CommType::all_reduce, 1}}))
        << format_comm_counts(comm.get_comm_counts());
    EXPECT_TENSOR_CLOSE(out, ref_out, 1e-12, 1e-12);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_TENSOR_CLOSE(full_tensor(tp.params()[i].grad()), ref.params()[i].grad(), 1e-12, 1e-12);
    }
    comm.enter();
    ref_opt.step();
    tp_opt.step();
    EXPECT_EQ(comm.get_total_counts(), 0);  // SGD needs no communication here
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_TENSOR_CLOSE(full_tensor(tp.params()[i].detach()), ref.params()[i].detach(), 1e-12,
                          1e-12);
    }
  });
}

TEST(CommCounts, SequenceParallelMlpGathersTwiceAndReduceScattersOnce) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    Mlp ref, tp;
    shard(*tp.net1, mesh, Shard(0), Shard(0));
    shard(*tp.net2, mesh, Shard(1), Replicate());
    at::manual_seed(0);
    auto full_x = at::rand({8, 10}, at::kDouble);  // each rank feeds its 2 rows
    auto x = full_x.chunk(4, 0)[rank];
    CommDebugMode comm;
    // Colwise(input_layouts=Shard(0)): gather the sequence, compute the column shard.
    auto in = redistribute(from_local(x, mesh, {Shard(0)}), {Replicate()});
    auto y = tp.net2(tp.net1(in).relu());
    // Rowwise(output_layouts=Shard(0)): reduce-scatter back onto the sequence.
    auto out = to_local(redistribute(y, {Shard(0)}));
    out.sum().backward();
    EXPECT_EQ(comm.get_comm_counts(), (CommCounts{{CommType::all_gather_into_tensor, 2},
                                                  {CommType::reduce_scatter_tensor, 1}}))
        << format_comm_counts(comm.get_comm_counts());
    auto ref_out = ref.net2(ref.net1(full_x).relu());
    ref_out.sum().backward();
    EXPECT_TENSOR_CLOSE(out, ref_out.chunk(4, 0)[rank], 1e-12, 1e-12);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_TENSOR_CLOSE(full_tensor(tp.params()[i].grad()), ref.params()[i].grad(), 1e-12, 1e-12);
    }
  });
}
