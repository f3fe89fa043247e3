#include <gtest/gtest.h>

#include <unordered_set>

#include "dtensor/core/placement.h"
#include "dtensor/core/shard_math.h"

using namespace dtensor;

TEST(Placement, EqualityAndHashFollowKindDimAndReduceOp) {
  EXPECT_EQ(Shard(0), Shard(0));
  EXPECT_NE(Shard(0), Shard(1));
  EXPECT_EQ(Replicate(), Replicate());
  EXPECT_EQ(Partial(), Partial(ReduceOp::Sum));
  EXPECT_NE(Partial(), Partial(ReduceOp::Max));
  EXPECT_NE(Shard(0), Replicate());
  // Equal placements hash equal and distinct ones apart: a set keeps one of each.
  std::unordered_set<Placement> set{
      Shard(0), Shard(1),    Replicate(),           Partial(), Partial(ReduceOp::Max),
      Shard(0), Replicate(), Partial(ReduceOp::Sum)};
  EXPECT_EQ(set.size(), 5u);
  const std::hash<Placement> h;
  EXPECT_NE(h(Shard(0)), h(Shard(1)));
  EXPECT_NE(h(Shard(0)), h(Replicate()));
  EXPECT_NE(h(Partial()), h(Partial(ReduceOp::Max)));
}

TEST(Placement, PrintsShortAndLongForms) {
  EXPECT_EQ(Shard(1).str(), "S(1)");
  EXPECT_EQ(Replicate().str(), "R");
  EXPECT_EQ(Partial().str(), "P(sum)");
  EXPECT_EQ(Shard(0).repr(), "Shard(dim=0)");
  Placements p{Shard(0), Replicate()};
  EXPECT_EQ(to_string(p), "(S(0), R)");
}

TEST(Placement, NegativeShardDimNormalises) {
  EXPECT_EQ(Shard(-1).normalized(3), Shard(2));
  EXPECT_EQ(Replicate().normalized(3), Replicate());
}

TEST(ShardMath, ChunkRuleGivesTrailingSmallerOrEmptyShards) {
  auto sizes = [](int64_t n, int64_t k) {
    std::vector<int64_t> s;
    for (int64_t r = 0; r < k; ++r) s.push_back(chunk_range(n, k, r).size);
    return s;
  };
  EXPECT_EQ(sizes(10, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(sizes(9, 4), (std::vector<int64_t>{3, 3, 3, 0}));
  EXPECT_EQ(sizes(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(sizes(6, 4), (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(sizes(3, 4), (std::vector<int64_t>{1, 1, 1, 0}));
  EXPECT_EQ(sizes(1, 4), (std::vector<int64_t>{1, 0, 0, 0}));
  EXPECT_EQ(sizes(0, 4), (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(sizes(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
}

TEST(ShardMath, EmptyShardReportsOffsetEqualToGlobalSize) {
  EXPECT_EQ(chunk_range(9, 4, 3).offset, 9);
  EXPECT_EQ(chunk_range(10, 4, 3).offset, 9);
  EXPECT_EQ(chunk_range(10, 4, 1).offset, 3);
}

TEST(ShardMath, NestedShardingAppliesMeshDimsLeftToRight) {
  // (10, 5) on a 2x2 mesh with [S0, S0]: mesh dim 0 splits 10 -> 5,5; dim 1 splits 5 -> 3,2.
  auto s = compute_local_shape_and_global_offset({10, 5}, {2, 2}, {1, 1}, {Shard(0), Shard(0)});
  EXPECT_EQ(s.shape, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(s.offset, (std::vector<int64_t>{8, 0}));
  auto t = compute_local_shape_and_global_offset({10, 5}, {2, 2}, {0, 1}, {Shard(0), Shard(1)});
  EXPECT_EQ(t.shape, (std::vector<int64_t>{5, 2}));
  EXPECT_EQ(t.offset, (std::vector<int64_t>{0, 3}));
}

TEST(ShardMath, GlobalStrideFromLocalMultipliesLargerStrides) {
  // local (8,4) contiguous, Shard(1) on 4 ranks -> global (8,16) stride (16,1)
  auto g = compute_global_shape_and_stride({8, 4}, {4, 1}, {4}, {Shard(1)});
  EXPECT_EQ(g.first, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(g.second, (std::vector<int64_t>{16, 1}));
  // local permuted (8,1,32) stride (1, 8, 8)... with Shard(1), n=4 -> global (8,4,32)
  auto h = compute_global_shape_and_stride({8, 1, 32}, {32, 32, 1}, {4}, {Shard(1)});
  EXPECT_EQ(h.first, (std::vector<int64_t>{8, 4, 32}));
  EXPECT_EQ(h.second, (std::vector<int64_t>{128, 32, 1}));
}
