// The PyTorch 2.0-era API (tp/compat.h): the make_input_* / make_output_* helpers and
// PairwiseParallel, against one device and with their collective counts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "dtensor/dtensor.h"
#include "dtensor/tp/compat.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

constexpr double kTol = 1e-10;

// A module whose only child is an MLP (no Linear of its own).
struct WrapperImpl : torch::nn::Module {
  explicit WrapperImpl(torch::nn::Sequential m) { mlp = register_module("mlp", std::move(m)); }
  at::Tensor forward(const at::Tensor& x) { return mlp->forward(x); }
  torch::nn::Sequential mlp{nullptr};
};
TORCH_MODULE(Wrapper);

}  // namespace

TEST(Compat, InputAndOutputHelpersKeepTheirPyTorch20Meaning) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    auto full = at::rand({8, 4, 8}, at::kDouble);  // the global tensor
    auto rows = full.chunk(4, 0)[rank];            // this rank's Shard(0) part
    CommDebugMode comm;

    auto r = tp::make_input_replicate_1d(full, mesh);  // plain: taken as the replica
    EXPECT_EQ(placements(r)[0], Replicate());
    EXPECT_TENSOR_EQ(local_tensor(r), full);
    auto s = tp::make_input_shard_1d(rows, mesh);  // plain: taken as the Shard(0) part
    EXPECT_EQ(placements(s)[0], Shard(0));
    EXPECT_EQ(s.sizes(), full.sizes());
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    EXPECT_TENSOR_EQ(full_tensor(tp::make_input_replicate_1d(s)), full);  // DTensor: gathered
    EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_gather_into_tensor, 1}}));

    comm.enter();
    auto last = tp::make_input_shard_1d_last_dim(r);  // DTensor: chunked, no comm
    EXPECT_EQ(placements(last)[0], Shard(2));
    EXPECT_TENSOR_EQ(local_tensor(last), full.chunk(4, 2)[rank]);
    auto last_plain = tp::make_input_shard_1d_last_dim(full.chunk(4, 2)[rank], mesh);
    EXPECT_EQ(placements(last_plain)[0], Shard(2));
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    auto reshard = tp::make_input_reshard_replicate(rows, mesh);
    EXPECT_EQ(placements(reshard)[0], Replicate());
    EXPECT_TENSOR_EQ(local_tensor(reshard), full);
    EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_gather_into_tensor, 1}}));

    comm.enter();
    EXPECT_TENSOR_EQ(local_tensor(tp::make_output_shard_1d(r, std::nullopt, 1)),
                     full.chunk(4, 1)[rank]);
    EXPECT_TENSOR_EQ(tp::make_output_reshard_tensor(r), rows);
    EXPECT_TENSOR_EQ(tp::make_sharded_output_tensor(s), rows);
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    auto partial = from_local(full * (rank + 1), mesh, {Partial()});
    auto reduced = tp::make_output_replicate_1d(partial, mesh);
    EXPECT_EQ(placements(reduced)[0], Replicate());
    EXPECT_TENSOR_CLOSE(local_tensor(reduced), full * 10, kTol, kTol);
    auto plain = tp::make_output_tensor(partial);
    EXPECT_FALSE(is_dtensor(plain));
    EXPECT_TENSOR_CLOSE(plain, full * 10, kTol, kTol);
    EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 2}}));

    EXPECT_ERROR(tp::make_input_replicate_1d(full), c10::Error,
                 "device_mesh is not passed nor can be inferred");
    EXPECT_ERROR(tp::make_output_tensor(full, mesh), c10::Error,
                 "Expect output of Tensor Parallel to be a DTensor");
    auto mesh2d = init_device_mesh("cpu", {2, 2});
    EXPECT_ERROR(tp::make_input_shard_1d(rows, mesh2d), c10::Error,
                 "device_mesh has dims 2 but expected to be 1 for input.");
  });
}

TEST(Compat, PairwiseParallelShardsMlpsInColumnRowPairs) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    auto make_mlp = [] {
      at::manual_seed(5);
      torch::nn::Sequential m(dtensor::nn::Linear(10, 16), torch::nn::ReLU(),
                              dtensor::nn::Linear(16, 10));
      m->to(at::kDouble);
      return m;
    };
    {
      SCOPED_TRACE("Linear, ReLU, Linear");
      auto ref = make_mlp();
      auto mlp = make_mlp();
      tp::parallelize_module(*mlp, mesh, tp::PairwiseParallel());
      auto* fc1 = mlp[0]->as<torch::nn::Linear>();
      auto* fc2 = mlp[2]->as<torch::nn::Linear>();
      EXPECT_EQ(placements(fc1->weight)[0], Shard(0));
      EXPECT_EQ(placements(fc1->bias)[0], Shard(0));
      EXPECT_EQ(placements(fc2->weight)[0], Shard(1));
      EXPECT_EQ(placements(fc2->bias)[0], Replicate());
      auto x = at::rand({6, 10}, at::kDouble);
      auto xr = x.clone().requires_grad_(true);
      auto xd = x.clone().requires_grad_(true);
      CommDebugMode comm;
      auto yd = mlp->forward(xd);
      EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 1}})) << comm.table();
      EXPECT_FALSE(is_dtensor(yd));
      auto yr = ref->forward(xr);
      EXPECT_TENSOR_CLOSE(yd, yr, kTol, kTol);
      yd.sum().backward();
      yr.sum().backward();
      EXPECT_TENSOR_CLOSE(xd.grad(), xr.grad(), kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(fc1->weight.grad()),
                          ref[0]->as<torch::nn::Linear>()->weight.grad(), kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(fc2->weight.grad()),
                          ref[2]->as<torch::nn::Linear>()->weight.grad(), kTol, kTol);
    }
    {
      SCOPED_TRACE("nested: four Linears (two pairs; plain Linears inside) and an odd fifth");
      auto build = [] {
        at::manual_seed(7);
        torch::nn::Sequential inner(dtensor::nn::Linear(8, 16), torch::nn::ReLU(),
                                    torch::nn::Linear(16, 8), torch::nn::ReLU(),
                                    torch::nn::Linear(8, 16), torch::nn::ReLU(),
                                    dtensor::nn::Linear(16, 8), torch::nn::Linear(8, 3));
        Wrapper outer(inner);
        outer->to(at::kDouble);
        return outer;
      };
      auto ref = build();
      auto model = build();
      tp::parallelize_module(*model, mesh, tp::PairwiseParallel());
      auto& inner = *model->mlp;
      EXPECT_EQ(placements(inner[2]->as<torch::nn::Linear>()->weight)[0], Shard(1));
      EXPECT_EQ(placements(inner[4]->as<torch::nn::Linear>()->weight)[0], Shard(0));
      EXPECT_FALSE(is_dtensor(inner[7]->as<torch::nn::Linear>()->weight));  // the odd one
      auto x = at::rand({5, 8}, at::kDouble);
      CommDebugMode comm;
      auto y = model(x);
      EXPECT_EQ(comm.get_comm_counts(), CommCounts({{CommType::all_reduce, 2}})) << comm.table();
      EXPECT_TENSOR_CLOSE(y, ref(x), kTol, kTol);
    }
    {
      SCOPED_TRACE("plain torch::nn::Linear at the MLP's ends is refused");
      torch::nn::Sequential plain(torch::nn::Linear(10, 16), torch::nn::ReLU(),
                                  torch::nn::Linear(16, 10));
      EXPECT_ERROR(tp::parallelize_module(*plain, mesh, tp::PairwiseParallel()), c10::Error,
                   "PairwiseParallel() cannot be applied to module '0' (torch::nn::Linear)",
                   "make_input_replicate_1d", "use dtensor::nn::Linear");
      EXPECT_FALSE(is_dtensor(plain[0]->as<torch::nn::Linear>()->weight));
    }
    (void)rank;
  });
}
