// tp::all_gather_matmul and tp::matmul_reduce_scatter against the same layers computed through
// DTensor sharding propagation (the hooks' path): bitwise equal outputs and gradients for 1-4
// pieces, exact collective counts, and the errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/tp/overlap.h"
#include "support/comm_counts.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/mpi_job.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

// Whole tensors drawn alike on every rank (run_ranks seeds them the same).
struct Data {
  at::Tensor x, w1, w2, wo;  // x (B, S, D); w1, w2 (H, D); wo (D, H)
};

Data draw(at::ScalarType dtype, int64_t S) {
  const auto o = at::TensorOptions(dtype);
  return {at::randn({2, S, 8}, o), at::randn({12, 8}, o), at::randn({12, 8}, o),
          at::randn({8, 12}, o)};
}

struct Result {
  at::Tensor out, gx, gw1, gw2, gwo;  // out: this rank's sequence shard; gradients local
  CommCounts forward, backward;
};

// silu(x W1^T) * (x W2^T), then Wo: the feed-forward's pair, overlapped or through DTensors.
Result run_pair(const DeviceMesh& mesh, const Data& d, bool overlap, int64_t chunks) {
  const int64_t n = mesh.size(), r = mesh.get_local_rank(), s = d.x.size(1) / n;
  at::Tensor x = d.x.narrow(1, r * s, s).clone().requires_grad_();
  at::Tensor w1 = distribute_tensor(d.w1, mesh, {Shard(0)}).requires_grad_();
  at::Tensor w2 = distribute_tensor(d.w2, mesh, {Shard(0)}).requires_grad_();
  at::Tensor wo = distribute_tensor(d.wo, mesh, {Shard(1)}).requires_grad_();
  Result res;
  CommDebugMode comm;
  if (overlap) {
    auto h = tp::all_gather_matmul(x, {w1, w2}, mesh, chunks);
    res.out = tp::matmul_reduce_scatter(at::silu(h[0]) * h[1], wo, mesh, chunks);
  } else {
    at::Tensor xr = redistribute(from_local(x, mesh, {Shard(1)}), {Replicate()});
    at::Tensor h = at::silu(to_local(at::linear(xr, w1))) * to_local(at::linear(xr, w2));
    at::Tensor y = at::linear(from_local(h, mesh, {Shard(-1)}), wo);
    res.out = to_local(redistribute(y, {Shard(1)}));
  }
  res.forward = comm.get_comm_counts();
  comm.enter();
  (res.out * res.out).sum().backward();
  res.backward = comm.get_comm_counts();
  res.gx = x.grad();
  res.gw1 = local_tensor(w1.grad());
  res.gw2 = local_tensor(w2.grad());
  res.gwo = local_tensor(wo.grad());
  return res;
}

}  // namespace

TEST(Overlap, PairIsBitwiseTheDTensorPathWithPiecesOfCollectives) {
  const auto sizes = world_sizes_to_run({2, 3, 4});
  if (sizes.empty()) GTEST_SKIP() << "runs with 2, 3 or 4 ranks";
  for (int n : sizes) {
    run_ranks(n, [](int) {
      auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
      const int64_t n = mesh.size();
      for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
        const Data d = draw(dtype, 4 * n);
        const Result ref = run_pair(mesh, d, false, 1);
        for (int64_t chunks : {1, 2, 3, 4}) {
          SCOPED_TRACE(c10::str("n=", n, " ", c10::toString(dtype), " chunks=", chunks));
          const Result got = run_pair(mesh, d, true, chunks);
          EXPECT_TRUE(at::equal(got.out, ref.out)) << "output";
          EXPECT_TRUE(at::equal(got.gx, ref.gx)) << "input gradient";
          EXPECT_TRUE(at::equal(got.gw1, ref.gw1)) << "w1 gradient";
          EXPECT_TRUE(at::equal(got.gw2, ref.gw2)) << "w2 gradient";
          EXPECT_TRUE(at::equal(got.gwo, ref.gwo)) << "wo gradient";
          // 4 positions per rank: 3 pieces become 2.
          const int64_t P = tp::overlap_chunks(4, chunks);
          EXPECT_EQ(P, chunks == 3 ? 2 : chunks);
          EXPECT_EQ(format_comm_counts(got.forward), format_comm_counts({{AG, P}, {RS, P}}));
          EXPECT_EQ(format_comm_counts(got.backward), format_comm_counts({{AG, 1}, {RS, 1}}));
          EXPECT_EQ(format_comm_counts(ref.forward), format_comm_counts({{AG, 1}, {RS, 1}}));
        }
      }
    });
  }
}

TEST(Overlap, RefusesWhatItCannotComputeNamingWhatItExpected) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const Data d = draw(at::kFloat, 8);
    at::Tensor w1 = distribute_tensor(d.w1, mesh, {Shard(0)});
    at::Tensor wo = distribute_tensor(d.wo, mesh, {Shard(1)});
    at::Tensor x = d.x.narrow(1, 0, 4);
    EXPECT_ERROR(tp::all_gather_matmul(x, {d.w1}, mesh, 2), c10::Error, "tp::all_gather_matmul",
                 "expected a 2-D DTensor Linear weight, got a plain tensor", "ColwiseParallel");
    EXPECT_ERROR(tp::all_gather_matmul(x, {wo}, mesh, 2), c10::Error,
                 "expected the weight as Shard(0)");
    EXPECT_ERROR(tp::all_gather_matmul(from_local(x, mesh, {Replicate()}), {w1}, mesh, 2),
                 c10::Error, "expected the input as this rank's sequence shard");
    EXPECT_ERROR(tp::matmul_reduce_scatter(at::randn({2, 7, 6}), wo, mesh, 2), c10::Error,
                 "tp::matmul_reduce_scatter", "sequence length 7 must be divisible by the 2 ranks");
    EXPECT_ERROR(tp::matmul_reduce_scatter(at::randn({2, 8, 6}), w1, mesh, 2), c10::Error,
                 "expected the weight as Shard(1)");
  });
}
