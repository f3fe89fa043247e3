// OpCensus counts the ops a computation runs on plain tensors: a composite op as its pieces, not
// what a counted op calls itself, a DTensor op as the local ops it runs on the shards. A training
// step of the bench preset's shapes with sequence parallelism and the vocab-parallel loss runs
// plain LibTorch's ops at TP=1 (but for two listed, explained differences), and at TP 2 and
// FSDP 2 x TP 2 plain's ops plus exactly the listed collectives and the extras still to remove.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/dispatch/op_census.h"
#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/mpi_job.h"

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

// ---- whole training steps ----
namespace {

using Counts = std::map<std::string, int64_t>;

// The bench preset's shapes (512 wide, 8 heads over 4 KV heads, vocabulary 4096) with two blocks.
models::DecoderConfig step_config() {
  models::DecoderConfig c = models::DecoderConfig::preset("bench");
  c.n_layers = 2;
  return c;
}

struct StepCensus {
  Counts ops;
  CommCounts collectives;
};

// The census of the second of two identical steps on 2 x 8 tokens (this dp rank's rows of them):
// zero_grad, forward, loss, backward, Partial gradients summed, clipping on the device, AdamW.
// Without a mesh the model stays plain LibTorch.
StepCensus census_of_step(const DeviceMesh* mesh, const models::ParallelizeOptions& options = {},
                          int64_t dp_rank = 0, int64_t dp = 1) {
  models::Transformer model(step_config());
  model->init_weights(1);
  if (mesh != nullptr && mesh->ndim() == 1 && mesh->size(0) == 1) {
    models::apply_tensor_parallel(*model, *mesh);  // TP on one rank (parallelize skips it)
  } else if (mesh != nullptr) {
    models::parallelize(*model, *mesh, options);
  }
  at::manual_seed(5);
  const at::Tensor tokens = at::randint(step_config().vocab_size, {2, 8});
  const at::Tensor mine = tokens.chunk(dp, 0)[dp_rank];
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  auto step = [&] {
    opt.zero_grad();
    models::loss_and_backward(model->forward(mine), mine);
    tp::reduce_partial_grads(*model);
    nn::utils::clip_grad_norm_on_device_(model->parameters(), 1.0);
    opt.step();
  };
  step();
  CommDebugMode comm;
  OpCensus census;
  step();
  return {census.counts(), comm.get_comm_counts()};
}

// b - a over the kinds whose counts differ.
Counts difference(const Counts& a, const Counts& b) {
  Counts d;
  for (const auto& [name, n] : b) d[name] += n;
  for (const auto& [name, n] : a) d[name] -= n;
  for (auto it = d.begin(); it != d.end();) it = it->second == 0 ? d.erase(it) : std::next(it);
  return d;
}

std::string str(const Counts& c) {
  std::string s;
  for (const auto& [name, n] : c) s += "{\"" + name + "\", " + std::to_string(n) + "}, ";
  return s;
}

// Where a DTensor step at TP=1 still differs from plain LibTorch's, per step (both equal in
// numerics): zero_grad's detach_ of a DTensor gradient is taken by the wrapper, so the local
// tensor (which has no history to cut) is not detached, one detach_ fewer per parameter; and
// the autograd engine sums two gradients in place (add_) only into a tensor that owns its
// storage, which a DTensor wrapper does not, so the sums whose first term is a DTensor run as
// add where plain's run as add_: inside each RMSNorm (its input feeds pow and mul) and the
// third of the three q/k/v projections' input gradients in each block.
Counts tp1_allowance(const models::DecoderConfig& c, int64_t n_params) {
  const int64_t sums = (2 * c.n_layers + 1) + c.n_layers;
  return {{"aten::add", sums}, {"aten::add_", -sums}, {"aten::detach_", -n_params}};
}

TEST(OpCensusStep, TensorParallelOnOneRankRunsPlainLibTorchsOpsOpForOp) {
  run_ranks(1, [](int) {
    const StepCensus plain = census_of_step(nullptr);
    const auto mesh = init_device_mesh("cpu", {1});
    const StepCensus tp1 = census_of_step(&mesh);
    const int64_t n_params =
        static_cast<int64_t>(models::Transformer(step_config())->parameters().size());
    EXPECT_EQ(difference(plain.ops, tp1.ops), tp1_allowance(step_config(), n_params))
        << str(difference(plain.ops, tp1.ops));
    EXPECT_EQ(tp1.collectives, CommCounts{}) << format_comm_counts(tp1.collectives);
  });
}

// A + b, kind by kind.
Counts plus(Counts a, const Counts& b) {
  for (const auto& [name, n] : b) a[name] += n;
  for (auto it = a.begin(); it != a.end();) it = it->second == 0 ? a.erase(it) : std::next(it);
  return a;
}

// The vocab-parallel loss's pieces (max, exp, sum, log and the target's gather on this rank's
// classes, masked by which targets are this rank's), against plain's _log_softmax and nll_loss.
const Counts kVocabParallelLoss = {{"aten::_log_softmax", -1},
                                   {"aten::_log_softmax_backward_data", -1},
                                   {"aten::nll_loss_backward", -1},
                                   {"aten::nll_loss_forward", -1},
                                   {"aten::_to_copy", 3},
                                   {"aten::amax", 1},
                                   {"aten::exp", 2},
                                   {"aten::gather", 1},
                                   {"aten::ge", 3},
                                   {"aten::log", 1},
                                   {"aten::logical_and", 4},
                                   {"aten::logical_not", 3},
                                   {"aten::logical_or", 1},
                                   {"aten::lt", 3},
                                   {"aten::masked_fill", 4},
                                   {"aten::masked_fill_", 1},
                                   {"aten::mul", 3},
                                   {"aten::ne", 2},
                                   {"aten::neg", 2},
                                   {"aten::scatter_add_", 1},
                                   {"aten::squeeze", 1},
                                   {"aten::sub", 5},
                                   {"aten::sum", 3},
                                   {"aten::unsqueeze", 5},
                                   {"aten::detach", 1}};

// Not yet removed at TP 2 (issue 41): the sequence-parallel redistributions' local reshuffles
// (an all-gather or reduce-scatter over the sequence dim, dim 1, goes through dim 0: split,
// select, stack, permute, copies into fresh buffers), the bucketed Partial-gradient sum (cat),
// and abs, div and pow not yet traced to their source. Asserted exactly so that any change
// shows here (then update the list).
const Counts kTensorParallelExtras = {
    {"aten::_unsafe_view", 10}, {"aten::abs", 1},     {"aten::cat", 1},    {"aten::clone", 26},
    {"aten::copy_", 30},        {"aten::div", 8},     {"aten::empty", 49}, {"aten::permute", 10},
    {"aten::pow", 2},           {"aten::select", 20}, {"aten::slice", 5},  {"aten::split", 30},
    {"aten::stack", 10},        {"aten::view", 60}};

// Not yet removed at FSDP 2 x TP 2: the above with FSDP's unit gathers and gradient
// reduce-scatters on top (flat buffers: empty, zeros, set_, slice, copy_, views; the
// casts _to_copy) and the clipping norm taken as sums of squares (pow, sum) over the dp and tp
// dims instead of one norm per gradient.
const Counts kFullyShardedTensorParallelExtras = {
    {"aten::_to_copy", 21}, {"aten::_unsafe_view", 39}, {"aten::add", 20},   {"aten::clone", 84},
    {"aten::copy_", 142},   {"aten::div", 2},           {"aten::div_", 3},   {"aten::empty", 83},
    {"aten::norm", -22},    {"aten::permute", 10},      {"aten::pow", 21},   {"aten::select", 33},
    {"aten::set_", 18},     {"aten::slice", 180},       {"aten::split", 38}, {"aten::sqrt", 1},
    {"aten::stack", 11},    {"aten::sum", 21},          {"aten::view", 196}, {"aten::zeros", 29}};

int64_t parameter_count() {
  return static_cast<int64_t>(models::Transformer(step_config())->parameters().size());
}

TEST(OpCensusStep, TensorParallelOnTwoRanksRunsPlainsOpsPlusTheListedCollectivesAndExtras) {
  run_ranks(2, [](int) {
    const StepCensus plain = census_of_step(nullptr);
    const auto mesh = init_device_mesh("cpu", {2});
    const StepCensus tp2 = census_of_step(&mesh);
    const Counts expected =
        plus(plus(tp1_allowance(step_config(), parameter_count()), kVocabParallelLoss),
             kTensorParallelExtras);
    // The MPI backend stages its collectives through buffers (empty, copy_, clone: ops of the
    // engine, not of the step), so the ops are compared on Gloo's forked ranks only.
    if (!dtensor::testing::in_mpi_job()) {
      EXPECT_EQ(difference(plain.ops, tp2.ops), expected) << str(difference(plain.ops, tp2.ops));
    }
    // Sequence parallelism, per block: the attention's and the FFN's input all-gathers (their
    // gradients reduce-scattered) and wo's and w2's output reduce-scatters (their gradients
    // gathered); the output projection's input and the embedding's output likewise. The loss's
    // max, sum and target all-reduces; one all-reduce each for the Partial norm gradients and
    // the gradient norm.
    EXPECT_EQ(tp2.collectives, (CommCounts{{CommType::all_reduce, 5},
                                           {CommType::all_gather_into_tensor, 10},
                                           {CommType::reduce_scatter_tensor, 10}}))
        << format_comm_counts(tp2.collectives);
  });
}

TEST(OpCensusStep, FullyShardedTensorParallelRunsPlainsOpsPlusTheListedCollectivesAndExtras) {
  run_ranks(4, [](int) {
    const StepCensus plain = census_of_step(nullptr);
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    models::ParallelizeOptions options;
    options.fully_shard = true;
    const StepCensus c = census_of_step(&mesh, options, mesh["dp"].get_local_rank(), 2);
    const Counts expected =
        plus(plus(tp1_allowance(step_config(), parameter_count()), kVocabParallelLoss),
             kFullyShardedTensorParallelExtras);
    if (!dtensor::testing::in_mpi_job()) {  // as above: MPI's staging buffers are the engine's ops
      EXPECT_EQ(difference(plain.ops, c.ops), expected) << str(difference(plain.ops, c.ops));
    }
    EXPECT_EQ(c.collectives, (CommCounts{{CommType::all_reduce, 10},
                                         {CommType::all_gather_into_tensor, 15},
                                         {CommType::reduce_scatter_tensor, 13}}))
        << format_comm_counts(c.collectives);
  });
}

}  // namespace
