// Every placement transition, on even, uneven and empty shards, against the single-device tensor,
// with PyTorch's exact collective counts (docs/ARCHITECTURE.md, "Redistribution").
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/comm_counts.h"
#include "support/distributed.h"

using namespace dtensor;
using dtensor::testing::counts;
using dtensor::testing::run_ranks;

namespace {

const CommCounts kNone{};

// The local shard this rank must hold of `global` laid out as `p`, by torch.chunk over each
// mesh dim in turn (independently of the library's shard math): a rank past the last chunk
// holds an empty slice.
at::Tensor expected_local(const at::Tensor& global, const DeviceMesh& mesh, const Placements& p) {
  at::Tensor t = global;
  const auto& coord = *mesh.coordinate();
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_shard()) continue;
    const int64_t d = p[m].dim();
    const auto pieces = t.chunk(mesh.size(static_cast<int64_t>(m)), d);
    const auto c = static_cast<size_t>(coord[m]);
    t = c < pieces.size() ? pieces[c] : t.narrow(d, t.size(d), 0);
  }
  return t;
}

// A DTensor holding `global` as `p`; Partial placements split the value evenly.
at::Tensor make(const at::Tensor& global, const DeviceMesh& mesh, const Placements& p) {
  at::Tensor local = expected_local(global, mesh, p);
  int64_t partial = 1;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i].is_partial()) partial *= mesh.size(static_cast<int64_t>(i));
  }
  local = local / partial;
  return from_local(local.clone(), mesh, p,
                    {.shape = global.sizes().vec(), .stride = global.strides().vec()});
}

std::string name(const Placements& a, const Placements& b, at::IntArrayRef shape) {
  std::ostringstream os;
  os << to_string(a) << " -> " << to_string(b) << " on " << shape;
  return os.str();
}

}  // namespace

// Each 1-D transition with its forward count, on shapes that shard evenly, unevenly (5 and
// 13 rows on 4 ranks), onto a single row (1 row on 4 ranks: three empty shards) and empty.
TEST(Redistribute1D, EveryTransitionMatchesTheSingleDeviceTensorWithExactCounts) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    struct Case {
      Placement from, to;
      CommCounts fwd;
    };
    const std::vector<Case> cases = {
        {Shard(0), Replicate(), counts({{CommType::all_gather_into_tensor, 1}})},
        {Shard(1), Replicate(), counts({{CommType::all_gather_into_tensor, 1}})},
        {Replicate(), Shard(0), kNone},
        {Replicate(), Shard(1), kNone},
        {Partial(), Replicate(), counts({{CommType::all_reduce, 1}})},
        {Partial(), Shard(0), counts({{CommType::reduce_scatter_tensor, 1}})},
        {Partial(), Shard(1), counts({{CommType::reduce_scatter_tensor, 1}})},
        {Shard(0), Shard(1), counts({{CommType::all_gather_into_tensor, 1}})},
        {Shard(1), Shard(0), counts({{CommType::all_gather_into_tensor, 1}})},
        {Replicate(), Replicate(), kNone},
        {Shard(0), Shard(0), kNone},
        {Partial(ReduceOp::Max), Replicate(), counts({{CommType::all_reduce, 1}})},
    };
    const std::vector<std::vector<int64_t>> shapes = {{8, 4}, {5, 3}, {13, 3},
                                                      {1, 4}, {3, 1}, {0, 4}};
    for (const auto& shape : shapes) {
      at::manual_seed(7);
      auto global = at::randn(shape, at::kDouble);
      for (const auto& c : cases) {
        Placements from{c.from}, to{c.to};
        SCOPED_TRACE(name(from, to, global.sizes()));
        at::Tensor dt;
        if (c.from.is_partial() && c.from.reduce_op() == ReduceOp::Max) {
          // every rank holds the max itself: reducing by max gives it back
          dt = from_local(global.clone(), mesh, from);
        } else {
          dt = make(global, mesh, from);
        }
        CommDebugMode comm;
        at::Tensor out = c.to.is_partial() ? dt : redistribute(dt, to);
        EXPECT_EQ(comm.get_comm_counts(), c.fwd) << format_comm_counts(comm.get_comm_counts());
        EXPECT_EQ(placements(out)[0], c.to);
        EXPECT_EQ(out.sizes(), global.sizes());
        EXPECT_TENSOR_CLOSE(local_tensor(out), expected_local(global, mesh, to), 1e-12, 1e-12);
        EXPECT_TENSOR_CLOSE(full_tensor(out), global, 1e-12, 1e-12);
      }
    }
  });
}

// Backward of each transition: the collective PyTorch's tests expect and the gradient.
TEST(Redistribute1D, BackwardIssuesTheMirrorCollective) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    for (auto shape : std::vector<std::vector<int64_t>>{{12, 3}, {13, 3}, {14, 3}}) {
      auto global = at::randn(shape, at::kDouble);
      {
        SCOPED_TRACE("S(0) -> R");
        auto x = distribute_tensor(global.clone().requires_grad_(true), mesh, {Shard(0)});
        CommDebugMode comm;
        auto y = redistribute(x, {Replicate()});
        EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::all_gather_into_tensor, 1}}));
        comm.enter();
        y.backward(at::ones_like(y));
        EXPECT_EQ(comm.get_comm_counts(), kNone);
        EXPECT_EQ(placements(x.grad())[0], Shard(0));
        EXPECT_TENSOR_EQ(full_tensor(x.grad()), at::ones_like(global));
      }
      {
        SCOPED_TRACE("R -> S(0)");
        auto x = distribute_tensor(global.clone().requires_grad_(true), mesh, {Replicate()});
        CommDebugMode comm;
        auto y = redistribute(x, {Shard(0)});
        EXPECT_EQ(comm.get_comm_counts(), kNone);
        comm.enter();
        y.backward(at::ones_like(y));
        EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::all_gather_into_tensor, 1}}));
        EXPECT_EQ(placements(x.grad())[0], Replicate());
        EXPECT_TENSOR_EQ(local_tensor(x.grad()), at::ones_like(global));
      }
      {
        SCOPED_TRACE("P -> R");
        auto local = at::ones(shape, at::kDouble).requires_grad_(true);
        auto x = from_local(local, mesh, {Partial()});
        CommDebugMode comm;
        auto y = redistribute(x, {Replicate()});
        EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::all_reduce, 1}}));
        EXPECT_TENSOR_EQ(local_tensor(y), at::full(shape, 4.0, at::kDouble));
        comm.enter();
        y.backward(at::ones_like(y));
        EXPECT_EQ(comm.get_comm_counts(), kNone);
        EXPECT_TENSOR_EQ(local.grad(), at::ones(shape, at::kDouble));
      }
      {
        SCOPED_TRACE("P -> S(0)");
        auto x = from_local(at::ones(shape, at::kDouble), mesh, {Partial()});
        CommDebugMode comm;
        auto y = redistribute(x, {Shard(0)});
        EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::reduce_scatter_tensor, 1}}));
        EXPECT_TENSOR_EQ(local_tensor(y),
                         4.0 * expected_local(at::ones(shape, at::kDouble), mesh, {Shard(0)}));
      }
    }
    {
      SCOPED_TRACE("R.redistribute(R).to_local(grad_placements=[P])");
      auto local = at::ones({4, 4}).requires_grad_(true);
      auto x = from_local(local, mesh, {Replicate()});
      CommDebugMode comm;
      auto y = to_local(redistribute(x, {Replicate()}), std::vector<Placement>{Partial()});
      y.sum().backward();
      EXPECT_EQ(comm.get_comm_counts(), counts({{CommType::all_reduce, 1}}));
      EXPECT_TENSOR_EQ(local.grad(), at::full({4, 4}, 4.0));
    }
  });
}

TEST(Redistribute1D, InternalReplicateToPartialDividesByTheMeshSize) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto global = at::arange(12, at::kDouble).view({4, 3});
    auto src = make_spec(mesh, {Replicate()}, {global.sizes().vec(), {3, 1}, at::kDouble});
    auto dst = src->with_placements({Partial()});
    CommDebugMode comm;
    auto out = redistribute_local(global, *src, *dst).wait();
    EXPECT_EQ(comm.get_total_counts(), 0);
    EXPECT_TENSOR_EQ(out, global / 4);
  });
}

// The greedy N-D planner's worked examples on a 2x2 mesh with their counts.
TEST(Redistribute2D, PlannerExamplesHaveTheExpectedCollectiveCounts) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    struct Case {
      std::vector<int64_t> shape;
      Placements from, to;
      int64_t collectives;
    };
    const std::vector<Case> cases = {
        {{8, 8}, {Shard(0), Shard(1)}, {Shard(0), Shard(0)}, 1},
        {{8, 8}, {Shard(0), Shard(1)}, {Shard(1), Shard(0)}, 2},
        {{8, 8}, {Shard(0), Shard(0)}, {Shard(1), Shard(1)}, 2},
        {{8, 8, 8}, {Shard(0), Shard(2)}, {Shard(1), Shard(0)}, 2},
        {{8, 8, 8}, {Shard(1), Shard(1)}, {Shard(1), Shard(2)}, 1},
    };
    for (const auto& c : cases) {
      SCOPED_TRACE(name(c.from, c.to, c.shape));
      auto global = at::randn(c.shape, at::kDouble);
      auto dt = make(global, mesh, c.from);
      CommDebugMode comm;
      auto out = redistribute(dt, c.to);
      EXPECT_EQ(comm.get_total_counts(), c.collectives);
      EXPECT_TENSOR_EQ(local_tensor(out), expected_local(global, mesh, c.to));
    }
    // Internal R,R -> P,P divides by 4.
    auto g = at::ones({4, 4}, at::kDouble);
    auto src = make_spec(mesh, {Replicate(), Replicate()}, {{4, 4}, {4, 1}, at::kDouble});
    auto out = redistribute_local(g, *src, *src->with_placements({Partial(), Partial()})).wait();
    EXPECT_TENSOR_EQ(out, g / 4);
  });
}

// Every combination of R / S(0) / S(1) / P on a 2x2 mesh to every R / S combination, on even and
// uneven shapes.
TEST(Redistribute2D, EveryPlacementCombinationRoundTripsEvenAndUneven) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    const std::vector<Placement> srcs = {Replicate(), Shard(0), Shard(1), Partial()};
    const std::vector<Placement> dsts = {Replicate(), Shard(0), Shard(1)};
    for (auto shape : std::vector<std::vector<int64_t>>{{8, 12}, {10, 5}, {9, 5}, {3, 5}, {1, 3}}) {
      auto global = at::randn(shape, at::kDouble);
      for (auto a : srcs) {
        for (auto b : srcs) {
          for (auto c : dsts) {
            for (auto d : dsts) {
              Placements from{a, b}, to{c, d};
              SCOPED_TRACE(name(from, to, global.sizes()));
              auto out = redistribute(make(global, mesh, from), to);
              EXPECT_TENSOR_CLOSE(local_tensor(out), expected_local(global, mesh, to), 1e-12,
                                  1e-12);
            }
          }
        }
      }
    }
  });
}

TEST(Redistribute2D, UnevenNestedShardsRoundTripThroughFullTensor) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    for (auto shape : std::vector<std::vector<int64_t>>{{10, 5}, {9, 5}, {3, 5}, {1, 3}}) {
      auto global = at::randn(shape);
      for (Placements p : {Placements{Shard(0), Shard(0)}, Placements{Shard(0), Shard(1)}}) {
        SCOPED_TRACE(name(p, p, global.sizes()));
        auto dt = distribute_tensor(global, mesh, p);
        EXPECT_TENSOR_EQ(local_tensor(dt), expected_local(global, mesh, p));
        EXPECT_TENSOR_EQ(full_tensor(dt), global);
      }
    }
  });
}

TEST(Redistribute1D, ThreeRanksShardAndGatherUnevenSizes) {
  run_ranks(3, [](int) {
    auto mesh = init_device_mesh("cpu", {3});
    for (int64_t rows : {1, 2, 4, 5, 7, 9}) {
      auto global = at::randn({rows, 2});
      auto dt = distribute_tensor(global, mesh, {Shard(0)});
      EXPECT_TENSOR_EQ(full_tensor(dt), global);
      EXPECT_TENSOR_EQ(full_tensor(redistribute(dt, {Shard(1)})), global);
    }
  });
}

// A mesh dim of one rank holds the whole along it: every transition over it is a relabel, with
// no collective (TP=1 then issues what plain LibTorch does). On a (2, 1) mesh only dim 0 talks.
TEST(Redistribute2D, AOneRankMeshDimIsARelabelWithoutCollectives) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 1}, {"dp", "tp"});
    const std::vector<Placement> all = {Replicate(), Shard(0), Shard(1), Partial(),
                                        Partial(ReduceOp::Avg)};
    const auto global = at::randn({6, 5}, at::kDouble);
    int cases = 0;
    for (const auto& dp : {Placement(Replicate()), Placement(Shard(0))}) {
      for (const auto& from : all) {
        for (const auto& to : all) {
          if (to.is_partial()) continue;  // a public target is never Partial
          SCOPED_TRACE(name({dp, from}, {dp, to}, global.sizes()));
          const Placements src = {dp, from}, dst = {dp, to};
          auto dt = make(global, mesh, src);
          CommDebugMode comm;
          auto out = redistribute(dt, dst);
          EXPECT_EQ(comm.get_total_counts(), 0);
          EXPECT_EQ(placements(out), dst);
          EXPECT_TENSOR_EQ(local_tensor(out), expected_local(global, mesh, dst));
          ++cases;
        }
      }
    }
    EXPECT_EQ(cases, 2 * 5 * 3);
    // Across both dims: only the 2-rank one issues its all-gather.
    auto dt = make(global, mesh, {Shard(0), Shard(1)});
    CommDebugMode comm;
    auto out = redistribute(dt, {Replicate(), Replicate()});
    EXPECT_EQ(comm.get_total_counts(), 1);
    EXPECT_TENSOR_EQ(local_tensor(out), global);
  });
}

// Every kind of dtype, through every transition that communicates (gathers, reductions,
// reduce-scatters), on uneven and empty shards, against the single-device tensor: complex
// numbers and int16 included, which Gloo cannot carry as they are.
TEST(Redistribute1D, EveryDtypeRedistributesLikeOneDevice) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    // One dtype of each way the collectives carry them (tests/comm/test_dtype_transport.cpp
    // takes every dtype through every collective).
    const std::vector<c10::ScalarType> dtypes = {
        at::kComplexFloat, at::kComplexDouble, at::kComplexHalf,   at::kShort,
        at::kBool,         at::kUInt64,        at::kFloat8_e4m3fn, at::kBFloat16};
    const std::vector<std::pair<Placement, Placement>> moves = {
        {Shard(0), Replicate()}, {Shard(1), Replicate()}, {Partial(), Replicate()},
        {Partial(), Shard(0)},   {Partial(), Shard(1)},   {Shard(0), Shard(1)},
        {Shard(1), Shard(0)},    {Replicate(), Shard(0)}};
    for (const auto dtype : dtypes) {
      for (const std::vector<int64_t>& shape : {std::vector<int64_t>{5, 3}}) {  // uneven
        at::manual_seed(11);  // the same global tensor on every rank
        at::Tensor global = at::randint(0, 3, shape, at::kDouble);
        if (c10::isComplexType(dtype)) global = at::complex(global, -global);
        global = dtype == at::kBool ? global.ne(0) : global.to(dtype);
        for (const auto& [from, to] : moves) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + name({from}, {to}, shape));
          // A Partial(sum) held whole by rank 0, as zeros by the others.
          at::Tensor local = from.is_partial()
                                 ? (rank == 0 ? global.clone() : at::zeros_like(global))
                                 : expected_local(global, mesh, {from}).clone();
          auto dt = from_local(local, mesh, {from},
                               {.shape = global.sizes().vec(), .stride = global.strides().vec()});
          auto out = redistribute(dt, {to});
          EXPECT_EQ(local_tensor(out).scalar_type(), dtype);
          EXPECT_TENSOR_EQ(local_tensor(out), expected_local(global, mesh, {to}));
          EXPECT_TENSOR_EQ(full_tensor(out), global);
        }
      }
    }
  });
}
