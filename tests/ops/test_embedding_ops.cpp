// Embedding: sweeps over weight/indices shapes x padding_idx x scale_grad_by_freq x placements x
// world sizes against one device (forward and weight gradient), torch::nn::Embedding with rowwise,
// colwise, replicated weights and batch-sharded indices, and PyTorch's collective counts
// (docs/ARCHITECTURE.md, "Expected collective counts").
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/sgd.h>

#include "dtensor/dtensor.h"
#include "support/comm_counts.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {}  // namespace

TEST(EmbeddingSweep, LookupAndGradientMatchOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      for (auto weight_shape : std::vector<std::vector<int64_t>>{{10, 4}, {7, 3}, {5, 3}}) {
        auto w = at::randn(weight_shape, at::kDouble);
        const int64_t vocab = weight_shape[0];
        for (auto index_shape : std::vector<std::vector<int64_t>>{{9}, {3, 4}}) {
          // Every id at least once where there is room, and repeats (for scale_grad_by_freq).
          auto idx = at::randint(vocab, index_shape, at::kLong);
          idx.flatten()
              .narrow(0, 0, std::min(vocab, idx.numel()))
              .copy_(at::arange(std::min(vocab, idx.numel())));
          for (int64_t padding : {int64_t{-1}, int64_t{2}}) {
            for (bool by_freq : {false, true}) {
              OpFn fn = [padding, by_freq](const std::vector<at::Tensor>& t) {
                return std::vector<at::Tensor>{at::embedding(t[0], t[1], padding, by_freq)};
              };
              std::vector<Placements> pi{{Replicate()}};
              for (int64_t d = 0; d < idx.dim(); ++d) pi.push_back({Shard(d)});
              for (auto& pl : combinations({placements_1d(2, true), pi})) {
                const auto label = "embedding " + c10::str(w.sizes()) + " ids " +
                                   c10::str(idx.sizes()) + " padding " + std::to_string(padding) +
                                   (by_freq ? " by freq " : " ") + to_string(pl[0]) + "x" +
                                   to_string(pl[1]);
                n.add(check_op(mesh, label, fn, {w, idx}, pl));
              }
            }
          }
        }
      }
      // 3 weights x (2 + 3 index layouts) x 2 paddings x 2 by_freq x 4 weight layouts.
      n.expect_cases(3 * (2 + 3) * 2 * 2 * 4, rank, c10::str("embedding, world ", world));
    });
  }
}

// The backward op called directly with every layout of grad_output and indices.
TEST(EmbeddingSweep, DenseBackwardMatchesOneDevice) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      auto idx = at::randint(6, {4, 3}, at::kLong);
      auto grad = at::randn({4, 3, 5}, at::kDouble);
      for (bool by_freq : {false, true}) {
        OpFn fn = [by_freq](const std::vector<at::Tensor>& t) {
          return std::vector<at::Tensor>{at::embedding_dense_backward(t[0], t[1], 6, 1, by_freq)};
        };
        for (auto& pl : combinations({placements_1d(3, true), placements_1d(2, false)})) {
          n.add(check_op(mesh,
                         std::string("embedding_dense_backward") + (by_freq ? " by freq " : " ") +
                             to_string(pl[0]) + "x" + to_string(pl[1]),
                         fn, {grad, idx}, pl, {.backward = false}));
        }
      }
      // 2 by_freq x 5 grad layouts x 3 index layouts.
      n.expect_cases(2 * 5 * 3, rank, c10::str("embedding_dense_backward, world ", world));
    });
  }
}

TEST(EmbeddingSweep, TwoDimensionalMeshMatchesOneDevice) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    SweepCounter n;
    auto w = at::randn({9, 6}, at::kDouble);
    auto idx = at::randint(9, {4, 3}, at::kLong);
    const std::vector<Placement> wc{Replicate(), Shard(0), Shard(1)};
    const std::vector<Placement> ic{Replicate(), Shard(0), Shard(1)};
    for (const auto& w0 : wc) {
      for (const auto& w1 : wc) {
        for (const auto& i0 : ic) {
          for (const auto& i1 : ic) {
            Placements pw{w0, w1}, pi{i0, i1};
            n.add(check_op(mesh, "embedding " + to_string(pw) + "x" + to_string(pi),
                           [](const std::vector<at::Tensor>& t) {
                             return std::vector<at::Tensor>{at::embedding(t[0], t[1])};
                           },
                           {w, idx}, {pw, pi}));
          }
        }
      }
    }
    n.expect_cases(3 * 3 * 3 * 3, rank, "embedding, 2x2 mesh");
  });
}

namespace {

// torch::nn::Embedding with its weight laid out as `wp` and indices as `ip`, against the
// same module on one device: output, weight gradient, and the weight after one SGD step.
struct ModuleRun {
  CommCounts forward, backward;
  Placements output, grad;
};

ModuleRun run_embedding_module(const DeviceMesh& mesh, const Placements& wp, const Placements& ip,
                               std::optional<int64_t> padding_idx) {
  auto options = torch::nn::EmbeddingOptions(16, 16).padding_idx(padding_idx);
  torch::nn::Embedding ref(options), emb(options);
  ref->to(at::kDouble);
  emb->to(at::kDouble);
  emb->weight.detach().copy_(ref->weight.detach());
  auto idx = at::randint(16, {4, 2}, at::kLong);
  if (padding_idx) idx[0][0] = *padding_idx;
  auto ct = at::randn({4, 2, 16}, at::kDouble);  // cotangent

  auto ref_out = ref(idx);
  (ref_out * ct).sum().backward();
  torch::optim::SGD(ref->parameters(), 0.5).step();

  replace_parameter(*emb, "weight", distribute_tensor(emb->weight.detach(), mesh, wp));
  auto didx = distribute_tensor(idx, mesh, ip);
  ModuleRun run;
  CommDebugMode comm;
  auto out = emb(didx);
  run.output = placements(out);
  run.forward = comm.get_comm_counts();
  EXPECT_TENSOR_CLOSE(full_tensor(out.detach()), ref_out.detach(), 1e-12, 1e-12);
  // The cotangent in the output's layout (Replicate for a Partial output), as a consumer of
  // the local output would hand it back.
  auto dct = distribute_tensor(ct, mesh, clear_partial(run.output));
  auto loss = (out * dct).sum();
  comm.enter();
  loss.backward();
  run.backward = comm.get_comm_counts();
  comm.exit();
  run.grad = placements(emb->weight.grad());
  EXPECT_EQ(emb->weight.grad().sizes(), ref->weight.sizes());
  EXPECT_TENSOR_CLOSE(full_tensor(emb->weight.grad()), ref->weight.grad(), 1e-12, 1e-12);
  torch::optim::SGD(emb->parameters(), 0.5).step();
  EXPECT_EQ(placements(emb->weight), wp);
  EXPECT_TENSOR_CLOSE(full_tensor(emb->weight.detach()), ref->weight.detach(), 1e-12, 1e-12);
  return run;
}

}  // namespace

TEST(EmbeddingModule, RowwiseColwiseReplicatedAndBatchShardedMatchOneDevice) {
  for (int world : {2, 4}) {
    run_ranks(world, [world](int) {
      auto mesh = init_device_mesh("cpu", {world});
      for (std::optional<int64_t> padding : {std::optional<int64_t>{}, std::optional<int64_t>{3}}) {
        SCOPED_TRACE(padding ? "padding_idx 3" : "no padding_idx");
        {
          SCOPED_TRACE("rowwise");
          auto r = run_embedding_module(mesh, {Shard(0)}, {Replicate()}, padding);
          EXPECT_EQ(r.forward, CommCounts{});
          EXPECT_EQ(r.output, Placements{Partial()});
          EXPECT_EQ(r.backward, CommCounts{});
          EXPECT_EQ(r.grad, Placements{Replicate()});  // full size, attached to a Shard(0) weight
        }
        {
          SCOPED_TRACE("colwise");
          auto r = run_embedding_module(mesh, {Shard(1)}, {Replicate()}, padding);
          EXPECT_EQ(r.forward, CommCounts{});
          EXPECT_EQ(r.output, Placements{Shard(2)});
          EXPECT_EQ(r.backward, CommCounts{});
          EXPECT_EQ(r.grad, Placements{Shard(1)});
        }
        {
          SCOPED_TRACE("replicated");
          auto r = run_embedding_module(mesh, {Replicate()}, {Replicate()}, padding);
          EXPECT_EQ(r.forward, CommCounts{});
          EXPECT_EQ(r.output, Placements{Replicate()});
          EXPECT_EQ(r.grad, Placements{Replicate()});
        }
        {
          SCOPED_TRACE("batch-sharded indices");
          auto r = run_embedding_module(mesh, {Replicate()}, {Shard(0)}, padding);
          EXPECT_EQ(r.forward, CommCounts{});
          EXPECT_EQ(r.output, Placements{Shard(0)});
          EXPECT_EQ(r.backward, CommCounts{});
          EXPECT_EQ(r.grad, Placements{Partial()});
        }
        {
          SCOPED_TRACE("rowwise weight, batch-sharded indices");
          run_embedding_module(mesh, {Shard(0)}, {Shard(1)}, padding);
        }
      }
    });
  }
}

// A rowwise embedding's output reduced to Replicate costs one all_reduce and nothing backward;
// reduced to Shard(1), one reduce_scatter forward and one all_gather backward. A colwise one costs
// nothing either way.
TEST(EmbeddingModule, CollectiveCountsLikePyTorch) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    torch::nn::Embedding emb(16, 16);
    auto w = emb->weight.detach().clone();
    replace_parameter(*emb, "weight", distribute_tensor(w, mesh, {Shard(0)}));
    auto idx = distribute_tensor(at::arange(8, at::kLong).reshape({4, 2}), mesh, {Replicate()});
    CommDebugMode comm;
    auto out = redistribute(emb(idx), {Replicate()});
    EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::all_reduce, 1}}));
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{4, 2, 16}));
    comm.enter();
    out.sum().backward();
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    EXPECT_TENSOR_EQ(full_tensor(out.detach()),
                     at::embedding(w, at::arange(8, at::kLong).reshape({4, 2})));

    emb->weight.mutable_grad().reset();
    auto flat = distribute_tensor(at::arange(8, at::kLong), mesh, {Replicate()});
    comm.enter();
    auto seq = redistribute(emb(flat), {Shard(1)});
    EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::reduce_scatter_tensor, 1}}));
    EXPECT_EQ(local_tensor(seq).sizes(), (std::vector<int64_t>{8, 4}));
    comm.enter();
    to_local(seq).sum().backward();  // as RowwiseParallel's local output would
    EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::all_gather_into_tensor, 1}}));

    torch::nn::Embedding col(16, 16);
    replace_parameter(*col, "weight", distribute_tensor(col->weight.detach(), mesh, {Shard(1)}));
    comm.enter();
    auto y = col(idx);
    EXPECT_EQ(comm.get_total_counts(), 0);
    EXPECT_EQ(placements(y)[0], Shard(2));
    to_local(y).sum().backward();
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    EXPECT_EQ(placements(col->weight.grad())[0], Shard(1));
  });
}
