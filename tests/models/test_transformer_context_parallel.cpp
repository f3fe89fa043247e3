// The decoder trained context-parallel (a ContextParallelScope around forward and backward,
// models::parallelize averaging the gradients over "cp", context_parallel_loss) against one
// device that runs each packed document alone, in float64: the loss, every gradient and every
// parameter after each of 3 AdamW steps agree to 1e-9, at cp 2 with the ring and the all-gather
// and at cp 2 x tp 2, on batches of documents of random lengths with padding; the collectives of
// each forward are the attention's formula per layer (plus tensor parallelism's own).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <random>
#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/models/parallelize.h"
#include "support/distributed.h"
#include "support/model_compare.h"
#include "support/mpi_job.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;
using cp::RotateMethod;

namespace {

constexpr int64_t kBatch = 2, kSeq = 24, kVocab = 64;

DecoderConfig tiny() {
  DecoderConfig c = DecoderConfig::preset("tiny");  // 4 heads sharing 2 KV heads
  c.vocab_size = kVocab;
  c.sliding_window = 5;  // the second layer slides
  c.sliding_layers = {false, true};
  return c;
}

// A batch of packed documents of random lengths (1..13; the second row ends in 4 tokens of
// padding), drawn alike on every rank: tokens, targets (the next token of the same document;
// -100 at each document's last token and on padding) and the rows' document lengths.
struct Batch {
  std::vector<std::vector<int64_t>> lengths;
  at::Tensor tokens, targets;
};

Batch draw_batch(int step) {
  std::mt19937 gen(static_cast<unsigned>(101 + step));
  std::uniform_int_distribution<int64_t> len(1, 13);
  Batch b;
  for (int64_t total : {kSeq, kSeq - 4}) {
    std::vector<int64_t> row;
    for (int64_t left = total; left > 0;) {
      row.push_back(std::min(left, len(gen)));
      left -= row.back();
    }
    b.lengths.push_back(row);
  }
  at::manual_seed(step);
  b.tokens = at::randint(kVocab, {kBatch, kSeq}, at::kLong);
  b.targets = at::full({kBatch, kSeq}, -100, at::kLong);
  for (int64_t r = 0; r < kBatch; ++r) {
    int64_t start = 0;
    for (int64_t l : b.lengths[r]) {
      if (l > 1)
        b.targets[r].narrow(0, start, l - 1).copy_(b.tokens[r].narrow(0, start + 1, l - 1));
      start += l;
    }
  }
  return b;
}

// One device: each document through the model alone (positions from 0, attention within it),
// the cross entropy summed over the real targets of rows [first, first + rows) and divided by
// their number.
at::Tensor one_device_loss(Transformer& model, const Batch& b, int64_t first = 0,
                           int64_t rows = kBatch) {
  at::Tensor sum = at::zeros({}, at::kDouble);
  for (int64_t r = first; r < first + rows; ++r) {
    int64_t start = 0;
    for (int64_t l : b.lengths[r]) {
      const at::Tensor logits = model->forward(b.tokens[r].narrow(0, start, l).unsqueeze(0));
      sum = sum + at::cross_entropy_loss(logits.flatten(0, 1), b.targets[r].narrow(0, start, l), {},
                                         at::Reduction::Sum);
      start += l;
    }
  }
  return sum / b.targets.narrow(0, first, rows).ne(-100).sum().item<double>();
}

// The attention's collectives of one forward per layer (context_attention's formula).
CommCounts attention_forward(RotateMethod rotate, int64_t cp, int64_t layers) {
  if (rotate == RotateMethod::all_gather) return {{CommType::all_gather_into_tensor, 2 * layers}};
  return {{CommType::send, (cp - 1) * layers}, {CommType::recv, (cp - 1) * layers}};
}

CommCounts plus(CommCounts a, const CommCounts& b) {
  for (const auto& [type, n] : b) a[type] += n;
  return a;
}

struct Layout {
  int64_t cp, tp;
  RotateMethod rotate;
  bool balanced;         // balanced_layout, else head_tail_layout
  int64_t dp_shard = 1;  // FSDP over dp_shard x cp; each dp rank trains on its rows
};

void expect_training_matches_one_device(const Layout& l) {
  run_ranks(static_cast<int>(l.dp_shard * l.cp * l.tp), [=](int) {
    ParallelDims dims{
        .dp_shard = l.dp_shard, .cp = l.cp, .tp = l.tp, .world_size = l.dp_shard * l.cp * l.tp};
    const DeviceMesh mesh = dims.build_mesh("cpu");
    const int64_t r = mesh.get_local_rank("cp"), rows = kBatch / l.dp_shard;
    const int64_t first = l.dp_shard > 1 ? mesh.get_local_rank("dp") * rows : 0;
    Transformer ref(tiny()), model(tiny());
    for (auto* m : {&ref, &model}) {
      (*m)->to(at::kDouble);
      (*m)->init_weights(3);
    }
    parallelize(*model, mesh, {.fully_shard = l.dp_shard > 1});
    if (l.dp_shard > 1) {  // every parameter sharded over the dp x cp ranks
      for (const auto& p : model->parameters()) {
        EXPECT_TRUE(fsdp::is_fsdp_shard(p));
        EXPECT_EQ(device_mesh(p).size(), l.dp_shard * l.cp * l.tp);
      }
    }
    const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    torch::optim::AdamW ref_opt(ref->parameters(), opt), model_opt(model->parameters(), opt);
    const Params ref_params = params_of(*ref), params = params_of(*model);
    ASSERT_EQ(params.size(), ref_params.size());
    const int64_t layers = tiny().n_layers;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      const Batch b = draw_batch(step);
      // This dp rank's rows.
      const at::Tensor ids = cp::document_ids_from_lengths(b.lengths, kSeq).narrow(0, first, rows);
      const cp::ContextLayout layout =
          l.balanced ? cp::balanced_layout(ids, l.cp) : cp::head_tail_layout(rows, kSeq, l.cp, ids);
      const at::Tensor tokens = layout.shard(b.tokens.narrow(0, first, rows), r),
                       targets = layout.shard(b.targets.narrow(0, first, rows), r, 1, -100);
      ref_opt.zero_grad();
      model_opt.zero_grad();
      // Data parallelism's loss: the mean over the dp ranks of each one's mean.
      at::Tensor ref_loss = at::zeros({}, at::kDouble);
      for (int64_t d = 0; d < l.dp_shard; ++d)
        ref_loss = ref_loss + one_device_loss(ref, b, d * rows, rows) / l.dp_shard;
      ref_loss.backward();

      // Tensor parallelism's own collectives of this forward: the same slots without the scope
      // (FSDP's gathers differ without gradients: only the ring's exchanges are counted then).
      CommCounts tp_forward;
      if (l.tp > 1 && l.dp_shard == 1) {
        at::NoGradGuard no_grad;
        CommDebugMode counts;
        model->forward(tokens);
        tp_forward = counts.get_comm_counts();
      }
      cp::ContextParallelScope scope({layout, mesh.get_group("cp"), l.rotate});
      CommDebugMode counts;
      const at::Tensor logits = model->forward(tokens);
      if (l.dp_shard == 1) {
        EXPECT_EQ(counts.get_comm_counts(),
                  plus(tp_forward, attention_forward(l.rotate, l.cp, layers)));
      } else {
        for (CommType type : {CommType::send, CommType::recv})
          EXPECT_EQ(counts.get_comm_counts()[type], (l.cp - 1) * layers);
      }
      counts.exit();
      const at::Tensor loss = context_parallel_loss(
          logits, targets, l.cp, b.targets.narrow(0, first, rows).ne(-100).sum().item<int64_t>());
      loss.backward();
      reduce_partial_grads(*model);
      // The mean over every rank (TP's ranks agree).
      const double mean_loss =
          comm::all_reduce(loss.detach(), ReduceOp::Sum, *comm::world_group()).item<double>() /
          static_cast<double>(l.dp_shard * l.cp * l.tp);
      EXPECT_NEAR(mean_loss, ref_loss.item<double>(), 1e-9) << "loss";
      for (const auto& [name, p] : params) {
        SCOPED_TRACE(name);
        ASSERT_TRUE(p.grad().defined());
        EXPECT_TRUE(close_to_scale(whole(p.grad()), ref_params.at(name).grad(), 1e-9))
            << "gradient";
      }
      ref_opt.step();
      model_opt.step();
      for (const auto& [name, p] : params) {
        SCOPED_TRACE(name);
        EXPECT_TRUE(close_to_scale(whole(p), ref_params.at(name), 1e-9))
            << "parameter after the step";
      }
    }
  });
}

}  // namespace

TEST(TransformerContextParallel, RingTrainingMatchesOneDeviceOnPackedDocumentsCp2) {
  if (world_sizes_to_run({2}).empty()) GTEST_SKIP() << "runs with 2 ranks";
  expect_training_matches_one_device({2, 1, RotateMethod::ring, true});
}

TEST(TransformerContextParallel, AllGatherTrainingMatchesOneDeviceOnPackedDocumentsCp2) {
  if (world_sizes_to_run({2}).empty()) GTEST_SKIP() << "runs with 2 ranks";
  expect_training_matches_one_device({2, 1, RotateMethod::all_gather, false});
}

TEST(TransformerContextParallel, RingTrainingMatchesOneDeviceCp4) {
  if (world_sizes_to_run({4}).empty()) GTEST_SKIP() << "runs with 4 ranks";
  expect_training_matches_one_device({4, 1, RotateMethod::ring, true});
}

// FSDP shards over the dp x cp ranks (torchtitan's dp_shard_cp); each dp rank its own row.
TEST(TransformerContextParallel, FsdpFoldedOverContextParallelismMatchesOneDeviceDp2Cp2) {
  if (world_sizes_to_run({4}).empty()) GTEST_SKIP() << "runs with 4 ranks";
  expect_training_matches_one_device({2, 1, RotateMethod::ring, true, /*dp_shard=*/2});
}

TEST(TransformerContextParallel, TrainingWithTensorParallelismMatchesOneDeviceCp2Tp2) {
  if (world_sizes_to_run({4}).empty()) GTEST_SKIP() << "runs with 4 ranks";
  expect_training_matches_one_device({2, 2, RotateMethod::ring, true});
  expect_training_matches_one_device({2, 2, RotateMethod::all_gather, true});
}
