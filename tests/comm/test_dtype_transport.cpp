// Every dtype LibTorch has moves through every collective, and reduces or is refused before any
// collective, on the engine in use (Gloo with forked ranks, MPI under the suite's mpirun entries)
// and on a group of one rank, against the same computation on one device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

namespace {

const std::vector<c10::ScalarType> kEveryDtype = {
    at::kBool,        at::kByte,         at::kChar,          at::kShort,  at::kInt,
    at::kLong,        at::kHalf,         at::kBFloat16,      at::kFloat,  at::kDouble,
    at::kComplexHalf, at::kComplexFloat, at::kComplexDouble, at::kUInt16, at::kUInt32,
    at::kUInt64,      at::kFloat8_e5m2,  at::kFloat8_e4m3fn};

// Rank `r`'s values of `shape` in `dtype`: small integers (every dtype holds their sums and
// products exactly), complex ones with an imaginary part, unsigned ones non-negative.
at::Tensor values_of(int64_t r, at::IntArrayRef shape, c10::ScalarType dtype) {
  at::manual_seed(100 + r);
  const bool is_unsigned = dtype == at::kByte || dtype == at::kUInt16 || dtype == at::kUInt32 ||
                           dtype == at::kUInt64 || dtype == at::kBool;
  at::Tensor re = at::randint(is_unsigned ? 0 : -2, 3, shape, at::kDouble);
  if (dtype == at::kBool) return re.ne(0);
  if (c10::isComplexType(dtype)) {
    return at::complex(re, at::randint(-2, 3, shape, at::kDouble)).to(dtype);
  }
  return re.to(dtype);
}

#define EXPECT_SAME_VALUES(actual, expected)         \
  do {                                               \
    const at::Tensor a_ = (actual), e_ = (expected); \
    EXPECT_EQ(a_.scalar_type(), e_.scalar_type());   \
    EXPECT_TENSOR_EQ(a_, e_);                        \
  } while (0)

// The reduction over ranks on one device, in a dtype with the arithmetic, rounded back.
at::Tensor reduce_on_one_device(const std::vector<at::Tensor>& all, ReduceOp op) {
  const auto dtype = all[0].scalar_type();
  const bool complex = c10::isComplexType(dtype);
  at::Tensor s = at::stack(all).to(complex ? at::kComplexDouble : at::kDouble);
  at::Tensor r;
  switch (op) {
    case ReduceOp::Sum:
      r = s.sum(0);
      break;
    case ReduceOp::Avg:  // complex values: each part divided, as a complex division would not
      r = at::view_as_real(s.sum(0).to(at::kComplexDouble)) / static_cast<double>(all.size());
      r = complex ? at::view_as_complex(r) : r.select(-1, 0);
      break;
    case ReduceOp::Max:
      r = s.amax(0);
      break;
    case ReduceOp::Min:
      r = s.amin(0);
      break;
    case ReduceOp::Product:
      r = s.prod(0);
      break;
  }
  if (dtype == at::kBool) return r.ne(0);  // any (sum, max), all (min, product)
  return r.to(dtype);
}

// What the collectives refuse, with the words of the refusal; empty when the reduction runs.
std::string refusal(c10::ScalarType dtype, ReduceOp op) {
  const bool integral = c10::isIntegralType(dtype, /*includeBool=*/true);
  if (op == ReduceOp::Avg && integral) return "an average of integers or booleans";
  if (c10::isComplexType(dtype) && op != ReduceOp::Sum && op != ReduceOp::Avg) {
    return "complex numbers are reduced by sum or avg only";
  }
  if (dtype == at::kUInt64 && (op == ReduceOp::Max || op == ReduceOp::Min)) {
    return "no engine orders unsigned 64-bit integers";
  }
  return "";
}

// Every collective on `g` for every dtype.
void check_every_collective(comm::ProcessGroup& g) {
  const int64_t k = g.size(), me = g.rank();
  const std::vector<int64_t> shape = {6, 6};  // divisible by 1, 2 and 3 ranks
  for (const auto dtype : kEveryDtype) {
    SCOPED_TRACE(std::string(c10::toString(dtype)) + " on " + std::to_string(k) + " rank(s)");
    std::vector<at::Tensor> all;
    for (int64_t r = 0; r < k; ++r) all.push_back(values_of(r, shape, dtype));
    const at::Tensor mine = all[me];

    EXPECT_SAME_VALUES(comm::all_gather_into_tensor(mine, 0, g), at::cat(all, 0));
    EXPECT_SAME_VALUES(comm::all_gather_into_tensor(mine, 1, g), at::cat(all, 1));
    std::vector<at::Tensor> received;  // chunk `me` of every rank's dim 1, along dim 0
    for (const auto& t : all) received.push_back(t.chunk(k, 1)[me]);
    EXPECT_SAME_VALUES(comm::all_to_all_single(mine, 1, 0, g), at::cat(received, 0));
    EXPECT_SAME_VALUES(comm::broadcast(mine, static_cast<int>(k - 1), g), all[k - 1]);
    std::vector<at::Tensor> parts;
    if (me == 0) parts = all[0].chunk(k, 1);  // non-contiguous chunks
    EXPECT_SAME_VALUES(comm::scatter(parts, all[0].chunk(k, 1)[me].contiguous(), 0, g),
                       all[0].chunk(k, 1)[me]);
    if (k > 1) {
      const int next = static_cast<int>((me + 1) % k), prev = static_cast<int>((me + k - 1) % k);
      auto sent = comm::isend(mine, next, g);
      EXPECT_SAME_VALUES(comm::recv(mine, prev, g), all[prev]);
      sent.wait();
    }
    if (c10::isComplexType(dtype)) {
      // A lazy conjugate is carried as its values.
      EXPECT_SAME_VALUES(comm::all_gather_into_tensor(mine.conj(), 0, g),
                         at::cat(all, 0).conj().resolve_conj());
    }

    for (const auto op :
         {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product}) {
      SCOPED_TRACE(reduce_op_name(op));
      const std::string refused = refusal(dtype, op);
      if (!refused.empty()) {
        CommDebugMode comm;
        EXPECT_ERROR(comm::all_reduce(mine, op, g), c10::Error, "all_reduce cannot reduce",
                     refused);
        EXPECT_ERROR(comm::reduce_scatter_tensor(mine, 0, op, g), c10::Error,
                     "reduce_scatter_tensor cannot reduce", refused);
        EXPECT_EQ(comm.get_total_counts(), 0);
        continue;
      }
      const at::Tensor whole = reduce_on_one_device(all, op);
      EXPECT_SAME_VALUES(comm::all_reduce(mine, op, g), whole);
      EXPECT_SAME_VALUES(comm::reduce_scatter_tensor(mine, 0, op, g), whole.chunk(k, 0)[me]);
      EXPECT_SAME_VALUES(comm::reduce_scatter_tensor(mine, 1, op, g), whole.chunk(k, 1)[me]);
    }
  }
}

}  // namespace

TEST(DtypeTransport, EveryDtypeMovesAndReducesOnTwoRanksAndOnAOneRankGroup) {
  run_ranks(2, [](int) {
    check_every_collective(*comm::world_group());
    auto mesh = init_device_mesh("cpu", {2, 1});
    check_every_collective(mesh.group(1));
  });
}

TEST(DtypeTransport, EveryDtypeMovesAndReducesOnThreeRanks) {
  run_ranks(3, [](int) { check_every_collective(*comm::world_group()); });
}

// A refused reduction leaves nothing behind: the next collective, and the next op, run.
TEST(DtypeTransport, ARefusedReductionLeavesTheProcessUsable) {
  run_ranks(2, [](int rank) {
    auto& g = *comm::world_group();
    const auto z = at::ones({4}, at::kComplexFloat);
    EXPECT_ERROR(comm::all_reduce(z, ReduceOp::Max, g), c10::Error,
                 "all_reduce cannot reduce ComplexFloat tensors by max");
    EXPECT_TENSOR_EQ(comm::all_reduce(at::full({4}, rank + 1.0), ReduceOp::Sum, g),
                     at::full({4}, 3.0));
    auto mesh = init_device_mesh("cpu", {2});
    auto x = from_local(z, mesh, {Partial(ReduceOp::Max)});
    EXPECT_ERROR(full_tensor(x), c10::Error, "cannot reduce ComplexFloat tensors by max");
    auto y = distribute_tensor(at::arange(8, at::kFloat), mesh, {Shard(0)});
    EXPECT_TENSOR_EQ(full_tensor(y * 2), at::arange(8, at::kFloat) * 2);
  });
}
