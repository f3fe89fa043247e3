// The recording backend: a simulated rank of a large world completes every collective at once,
// creates only its own groups, and records each call as CommDebugMode counts it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/comm/recording_backend.h"
#include "dtensor/dtensor.h"

using namespace dtensor;

namespace {

// Joins a simulated world for one test and leaves it after.
struct Simulated {
  Simulated(int world_size, int rank) {
    comm::init_simulated_process_group({world_size, rank});
    comm::clear_recorded_ops();
  }
  ~Simulated() {
    comm::destroy_process_group();
    comm::clear_recorded_ops();
  }
};

at::Tensor meta(std::vector<int64_t> sizes, at::ScalarType dtype = at::kFloat) {
  return at::empty(sizes, at::TensorOptions().device(at::kMeta).dtype(dtype));
}

// "c10d_functional.all_reduce" -> "all_reduce", "c10d.recv_" -> "recv".
std::string short_name(CommType t) {
  std::string s = comm_type_name(t);
  s = s.substr(s.find('.') + 1);
  if (s.back() == '_') s.pop_back();
  return s;
}

}  // namespace

TEST(RecordingBackend, SimulatedRankOfA512RankWorldCreatesOnlyItsOwnGroups) {
  Simulated world(512, 77);
  EXPECT_TRUE(comm::is_simulated());
  EXPECT_EQ(comm::get_world_size(), 512);
  EXPECT_EQ(comm::get_rank(), 77);
  auto mesh = init_device_mesh("meta", {8, 8, 8}, {"pp", "dp", "tp"});
  // 77 = 1*64 + 1*8 + 5.
  EXPECT_EQ(*mesh.coordinate(), (std::vector<int64_t>{1, 1, 5}));
  EXPECT_EQ(mesh.group(0).global_ranks(), (std::vector<int>{13, 77, 141, 205, 269, 333, 397, 461}));
  EXPECT_EQ(mesh.group(2).global_ranks(), (std::vector<int>{72, 73, 74, 75, 76, 77, 78, 79}));
  EXPECT_EQ(mesh.group(1).rank(), 1);
}

TEST(RecordingBackend, CollectivesOnMetaTensorsCompleteAndAreRecordedAsCommDebugModeCountsThem) {
  Simulated world(16, 5);
  auto mesh = init_device_mesh("meta", {4, 4}, {"dp", "tp"});
  auto& tp = mesh.group(1);
  auto& dp = mesh.group(0);
  CommDebugMode comm;
  auto ar = comm::all_reduce(meta({3, 5}), ReduceOp::Sum, tp);
  auto ag = comm::all_gather_into_tensor(meta({2, 6}, at::kBFloat16), 1, tp);
  auto rs = comm::reduce_scatter_tensor(meta({8, 3}), 0, ReduceOp::Avg, dp);
  auto sent = comm::isend(meta({4}, at::kDouble), 0, dp);
  auto got = comm::recv(meta({7}), 2, dp);
  sent.wait();
  EXPECT_TRUE(ar.is_meta());
  EXPECT_EQ(ar.sizes(), (at::IntArrayRef{3, 5}));
  EXPECT_EQ(ag.sizes(), (at::IntArrayRef{2, 24}));
  EXPECT_EQ(rs.sizes(), (at::IntArrayRef{2, 3}));
  EXPECT_EQ(got.sizes(), (at::IntArrayRef{7}));

  const auto ops = comm::recorded_ops();
  ASSERT_EQ(ops.size(), 5u);
  const std::vector<std::string> names{"all_reduce", "all_gather_into_tensor",
                                       "reduce_scatter_tensor", "send", "recv"};
  const std::vector<int64_t> bytes{60, 24, 96, 32, 28};
  const std::vector<int> dims{1, 1, 0, 0, 0};
  const std::vector<at::ScalarType> dtypes{at::kFloat, at::kBFloat16, at::kFloat, at::kDouble,
                                           at::kFloat};
  const auto seen = comm.records();
  ASSERT_EQ(seen.size(), 5u);
  for (size_t i = 0; i < ops.size(); ++i) {
    SCOPED_TRACE(ops[i].op);
    EXPECT_EQ(ops[i].op, names[i]);
    EXPECT_EQ(ops[i].bytes, bytes[i]);
    EXPECT_EQ(ops[i].mesh_dim, dims[i]);
    EXPECT_EQ(ops[i].group_size, 4);
    EXPECT_EQ(ops[i].dtype, dtypes[i]);
    EXPECT_EQ(ops[i].phase, "forward");
    EXPECT_EQ(ops[i].bytes, seen[i].bytes);  // CommDebugMode's byte convention
    EXPECT_EQ(ops[i].mesh_dim, seen[i].mesh_dim);
    EXPECT_EQ(ops[i].op, short_name(seen[i].type));
  }
  EXPECT_EQ(ops[0].group, tp.name());
  EXPECT_EQ(ops[2].group, dp.name());
}

TEST(RecordingBackend, RealTensorsAreLeftWithThisRanksValues) {
  Simulated world(4, 2);
  auto mesh = init_device_mesh("cpu", {4});
  auto x = at::arange(6, at::kFloat);
  EXPECT_TRUE(at::equal(comm::all_reduce(x, ReduceOp::Sum, mesh.group(0)), x));
  // An average divides this rank's value by the group size, as after a real reduction.
  EXPECT_TRUE(at::equal(comm::all_reduce(x, ReduceOp::Avg, mesh.group(0)), x / 4));
}

TEST(RecordingBackend, DTensorRedistributeOnMetaShardsRecordsTheLocalShardsBytes) {
  Simulated world(64, 9);
  auto mesh = init_device_mesh("meta", {8, 8}, {"dp", "tp"});
  auto tp_mesh = mesh["tp"];
  auto local = meta({4, 16});
  auto d = from_local(local, tp_mesh, {Shard(0)});
  EXPECT_EQ(d.sizes(), (at::IntArrayRef{32, 16}));
  auto full = redistribute(d, tp_mesh, {Replicate()});
  EXPECT_EQ(to_local(full).sizes(), (at::IntArrayRef{32, 16}));
  const auto ops = comm::recorded_ops();
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].op, "all_gather_into_tensor");
  EXPECT_EQ(ops[0].bytes, 4 * 16 * 4);
  EXPECT_EQ(ops[0].group_size, 8);
  EXPECT_EQ(ops[0].mesh_dim, 1);
}

TEST(RecordingBackend, PhasesForwardBackwardAndOptimizer) {
  Simulated world(8, 3);
  auto mesh = init_device_mesh("meta", {8});
  auto w = from_local(meta({8, 4}).requires_grad_(), mesh, {Replicate()});
  auto rows = redistribute(w, mesh, {Shard(0)});        // local; its backward: an all_gather
  auto full = redistribute(rows, mesh, {Replicate()});  // all_gather; its backward: local
  to_local(full).sum().backward();
  {
    comm::RecordingPhase optimizer("optimizer");
    comm::all_reduce(meta({1}), ReduceOp::Sum, mesh.group(0));
  }
  comm::all_reduce(meta({1}), ReduceOp::Sum, mesh.group(0));
  const auto ops = comm::recorded_ops();
  ASSERT_EQ(ops.size(), 4u);
  EXPECT_EQ(ops[0].phase, "forward");
  EXPECT_EQ(ops[1].phase, "backward");
  EXPECT_EQ(ops[2].phase, "optimizer");
  EXPECT_EQ(ops[3].phase, "forward");
}

TEST(RecordingBackend, RejectsARankOutsideTheWorldAndRejoinsAsAnotherRank) {
  EXPECT_THROW(comm::init_simulated_process_group({4, 4}), c10::Error);
  EXPECT_FALSE(comm::is_initialized());
  {
    Simulated first(4, 0);
    EXPECT_EQ(comm::get_rank(), 0);
  }
  {
    Simulated second(4, 3);
    EXPECT_EQ(comm::get_rank(), 3);
    EXPECT_EQ(init_device_mesh("meta", {2, 2}).coordinate()->at(0), 1);
  }
}
