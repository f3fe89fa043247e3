// OpCensus counts the ops a computation runs on plain tensors: a composite op as its pieces, not
// what a counted op calls itself, a DTensor op as the local ops it runs on the shards.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dispatch/op_census.h"
#include "dtensor/dtensor.h"
#include "support/distributed.h"

using namespace dtensor;
using namespace dtensor::testing;
using dtensor::dispatch::OpCensus;

namespace {

TEST(OpCensus, CountsTheOutermostPlainOpsOfACompositeOp) {
  const at::Tensor x = at::randn({4, 3}), w = at::randn({5, 3}), b = at::randn({5});
  OpCensus census;
  (void)at::linear(x, w, b);  // linear (decomposes) -> t (-> transpose), addmm (-> resolve_conj)
  EXPECT_EQ(census.counts(), (std::map<std::string, int64_t>{{"aten::addmm", 1}, {"aten::t", 1}}));
  EXPECT_EQ(census.total(), 2);
}

TEST(OpCensus, ADTensorOpCountsAsTheLocalOpsItRuns) {
  run_ranks(1, [](int) {
    auto mesh = init_device_mesh("cpu", {1});
    const at::Tensor a = distribute_tensor(at::randn({4, 3}), mesh, {Replicate()});
    const at::Tensor b = distribute_tensor(at::randn({3, 5}), mesh, {Shard(1)});
    (void)at::mm(a, b);  // decided once, outside the census
    OpCensus census;
    (void)at::mm(a, b);
    EXPECT_EQ(census.counts(), (std::map<std::string, int64_t>{{"aten::mm", 1}}));
  });
}

}  // namespace
