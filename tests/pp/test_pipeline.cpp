// Pipeline parallelism: point-to-point messages, the schedules' order, and the bundled Llama
// split into stages over a (pp, tp) mesh. For (pp, tp) = (2, 1), (4, 1) and (2, 2), GPipe and
// 1F1B with 1, 2 and 4 micro-batches, tied and untied embeddings, three AdamW steps give the
// same loss, every gradient and every parameter as the whole model on one device from the same
// seed (float64, 1e-9). A step issues exactly 2 * (pp - 1) * M sends and as many receives per
// pp group (plus one of each per tied stage), and the TP collectives of the non-pipelined plan
// without sequence parallelism, M times. A stage that raises ends every rank naming the stage,
// the micro-batch and the message it waited for.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/optim/adamw.h>

#include <map>
#include <string>
#include <thread>

#include "dtensor/dtensor.h"
#include "dtensor/models/llama_pipeline.h"
#include "dtensor/pp/pipeline.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/model_compare.h"
#include "support/mpi_job.h"
#include "support/rank_outcomes.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

constexpr int64_t kBatch = 4, kSeq = 8;

LlamaConfig tiny(bool tied) {
  auto c = LlamaConfig::preset("tiny");
  c.vocab_size = 64;
  c.n_layers = 4;
  c.tie_embeddings = tied;
  return c;
}

enum class Kind { GPipe, OneFOneB };

std::unique_ptr<pp::Schedule> make_schedule(Kind kind, pp::PipelineStage& stage, int64_t m) {
  auto loss = [](const at::Tensor& out, const at::Tensor& target) {
    return token_cross_entropy(out, target);
  };
  if (kind == Kind::GPipe) return std::make_unique<pp::ScheduleGPipe>(stage, m, loss);
  return std::make_unique<pp::Schedule1F1B>(stage, m, loss);
}

DeviceMesh pp_tp_mesh(int64_t pp, int64_t tp) {
  if (tp == 1) return init_device_mesh("cpu", {pp}, {"pp"});
  return init_device_mesh("cpu", {pp, tp}, {"pp", "tp"});
}

// This rank's stage of the tiny Llama from seed 11, tensor-parallel when the mesh has a tp dim.
struct Built {
  LlamaStage stage{nullptr};
  std::unique_ptr<pp::PipelineStage> pipe;
};
Built build_stage(const DeviceMesh& mesh, const LlamaConfig& config) {
  Transformer whole(config);
  whole->to(at::kDouble);
  whole->init_weights(11);
  Built b;
  b.stage = split_llama_stage(*whole, mesh);
  if (mesh.ndim() > 1) apply_tensor_parallel(*b.stage, mesh, {.loss_parallel = true});
  b.pipe = make_llama_pipeline_stage(b.stage, mesh);
  return b;
}

// The reference name of a stage parameter: the last stage's copy of a tied embedding is the
// whole model's tok_embeddings.weight.
std::string reference_name(const LlamaStageImpl& stage, const std::string& name) {
  return stage.tied_across_stages() && name == "output.weight" ? "tok_embeddings.weight" : name;
}

void expect_training_matches(const DeviceMesh& mesh, Kind kind, int64_t m, bool tied) {
  const auto config = tiny(tied);
  Transformer ref(config);
  ref->to(at::kDouble);
  ref->init_weights(11);
  Built b = build_stage(mesh, config);
  auto schedule = make_schedule(kind, *b.pipe, m);
  const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW ref_opt(ref->parameters(), opt), opt_stage(b.stage->parameters(), opt);
  const auto ref_params = params_of(*ref), params = params_of(*b.stage);
  for (const auto& [name, p] : params) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(ref_params.count(reference_name(*b.stage, name)));
    EXPECT_TRUE(close_to_scale(whole(p), ref_params.at(reference_name(*b.stage, name)), 0.0));
  }
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Identical on every rank: run_ranks seeds each rank alike.
    auto tokens = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
    auto targets = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
    ref_opt.zero_grad();
    opt_stage.zero_grad();
    auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
    auto loss = schedule->step(tokens, targets);
    reduce_partial_grads(*b.stage);
    EXPECT_EQ(loss.defined(), b.pipe->is_last());
    if (loss.defined()) {
      EXPECT_TRUE(close_to_scale(loss, ref_loss, 1e-9)) << "loss";
    }
    for (const auto& [name, p] : params) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_TRUE(close_to_scale(whole(p.grad()),
                                 ref_params.at(reference_name(*b.stage, name)).grad(), 1e-9))
          << "gradient";
    }
    ref_opt.step();
    opt_stage.step();
    for (const auto& [name, p] : params) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(close_to_scale(whole(p), ref_params.at(reference_name(*b.stage, name)), 1e-9))
          << "parameter after the step";
    }
  }
}

void expect_parity_for_layout(int64_t pp, int64_t tp) {
  run_ranks(static_cast<int>(pp * tp), [pp, tp](int) {
    auto mesh = pp_tp_mesh(pp, tp);
    for (bool tied : {false, true}) {
      for (Kind kind : {Kind::GPipe, Kind::OneFOneB}) {
        for (int64_t m : {1, 2, 4}) {
          SCOPED_TRACE("pp=" + std::to_string(pp) + " tp=" + std::to_string(tp) +
                       (kind == Kind::GPipe ? " GPipe" : " 1F1B") + " M=" + std::to_string(m) +
                       (tied ? " tied" : " untied"));
          expect_training_matches(mesh, kind, m, tied);
        }
      }
    }
  });
}

int64_t count(const CommCounts& c, CommType t) {
  auto it = c.find(t);
  return it == c.end() ? 0 : it->second;
}

}  // namespace

TEST(PointToPoint, SendAndRecvDeliverInOrderPerTagAndAreCounted) {
  run_ranks(2, [](int rank) {
    auto& pg = *comm::world_group();
    CommDebugMode debug;
    if (rank == 0) {
      // Posted before the peer receives: neither end waits for the other to start.
      auto a = comm::isend(at::arange(6, at::kDouble).view({2, 3}), 1, pg, 5);
      auto b = comm::isend(at::full({4}, 7.0), 1, pg, 6);
      auto c = comm::isend(at::full({4}, 8.0), 1, pg, 6);
      at::Tensor back = comm::recv(at::empty({3}, at::kLong), 1, pg, 2);
      a.wait();
      b.wait();
      c.wait();
      EXPECT_TENSOR_EQ(back, at::tensor({1, 2, 3}, at::kLong));
      EXPECT_EQ(debug.get_comm_counts(), (CommCounts{{CommType::send, 3}, {CommType::recv, 1}}));
    } else {
      // Receives in another order than the tags were sent: tags keep them apart.
      at::Tensor b = comm::recv(at::empty({4}), 0, pg, 6);
      at::Tensor a = comm::recv(at::empty({2, 3}, at::kDouble), 0, pg, 5);
      at::Tensor c = comm::recv(at::empty({4}), 0, pg, 6);
      comm::send(at::tensor({1, 2, 3}, at::kLong), 0, pg, 2);
      EXPECT_TENSOR_EQ(a, at::arange(6, at::kDouble).view({2, 3}));
      EXPECT_TENSOR_EQ(b, at::full({4}, 7.0));
      EXPECT_TENSOR_EQ(c, at::full({4}, 8.0));
      EXPECT_EQ(debug.get_comm_counts(), (CommCounts{{CommType::send, 1}, {CommType::recv, 3}}));
    }
    EXPECT_EQ(comm_type_name(CommType::send), std::string("c10d.send"));
    EXPECT_EQ(comm_type_name(CommType::recv), std::string("c10d.recv_"));
    EXPECT_CONTAINS(message_of([&] { comm::send(at::ones({1}), rank, pg); }),
                    "is not another member");
  });
}

TEST(PipelineSchedule, ActionsOfGPipeAnd1F1B) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4}, {"pp"});
    pp::PipelineStage stage([](const at::Tensor& x) { return x; }, mesh);
    EXPECT_EQ(stage.stage_index(), rank);
    auto loss = [](const at::Tensor& out, const at::Tensor&) { return out.sum(); };
    pp::ScheduleGPipe gpipe(stage, 3, loss);
    pp::Schedule1F1B one(stage, 4, loss);
    EXPECT_EQ(pp::format_actions(gpipe.actions()), "F0 F1 F2 B0 B1 B2");
    // Stage s warms up with pp - 1 - s forwards.
    const std::vector<std::string> expected{"F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 B0 F3 B1 B2 B3",
                                            "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"};
    EXPECT_EQ(pp::format_actions(one.actions()), expected[rank]);
    EXPECT_EQ(pp::stage_layer_range(10, rank, 4),
              (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 6}, {6, 8}, {8, 10}}[rank]));
  });
}

TEST(LlamaPipeline, TrainingMatchesOneDevicePp2) { expect_parity_for_layout(2, 1); }
TEST(LlamaPipeline, TrainingMatchesOneDevicePp4) { expect_parity_for_layout(4, 1); }
TEST(LlamaPipeline, TrainingMatchesOneDevicePp2Tp2) { expect_parity_for_layout(2, 2); }

// Per step and pp group: 2 * (pp - 1) * M sends and as many receives (one activation forward
// and one gradient backward per boundary and micro-batch), plus one send and one receive on
// each of the two stages holding a tied embedding; the first step sends each boundary's
// activation shape once more. The TP collectives summed over the stages are the whole model's
// (plan without sequence parallelism) M times.
TEST(LlamaPipeline, MessagesPerStepFollowTheFormula) {
  for (const auto& layout :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{2, 1, 4}, {4, 1, 2}, {2, 2, 2}}) {
    const int64_t pp = std::get<0>(layout), tp = std::get<1>(layout), m = std::get<2>(layout);
    run_ranks(static_cast<int>(pp * tp), [pp, tp, m](int) {
      auto mesh = pp_tp_mesh(pp, tp);
      for (bool tied : {false, true}) {
        for (Kind kind : {Kind::GPipe, Kind::OneFOneB}) {
          SCOPED_TRACE("pp=" + std::to_string(pp) + " tp=" + std::to_string(tp) +
                       " M=" + std::to_string(m) + (kind == Kind::GPipe ? " GPipe" : " 1F1B") +
                       (tied ? " tied" : " untied"));
          const auto config = tiny(tied);
          Built b = build_stage(mesh, config);
          auto schedule = make_schedule(kind, *b.pipe, m);
          const int64_t s = b.pipe->stage_index();
          const int64_t ties = tied && (b.pipe->is_first() || b.pipe->is_last()) ? 1 : 0;
          const int64_t neighbours = (s > 0 ? 1 : 0) + (s < pp - 1 ? 1 : 0);
          CommCounts counts;
          for (int step = 0; step < 2; ++step) {
            auto tokens = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
            auto targets = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
            CommDebugMode debug;
            schedule->step(tokens, targets);
            reduce_partial_grads(*b.stage);
            counts = debug.get_comm_counts();
            const int64_t shape_sends = step == 0 && s < pp - 1 ? 1 : 0;
            const int64_t shape_recvs = step == 0 && s > 0 ? 1 : 0;
            EXPECT_EQ(count(counts, CommType::send), m * neighbours + ties + shape_sends)
                << debug.table();
            EXPECT_EQ(count(counts, CommType::recv), m * neighbours + ties + shape_recvs)
                << debug.table();
          }
          // Totals over the pp group (outside the counted region).
          auto& pp_group = mesh.group(0);  // pp is dim 0
          std::vector<int64_t> mine;
          for (CommType t :
               {CommType::all_reduce, CommType::all_gather_into_tensor,
                CommType::reduce_scatter_tensor, CommType::all_to_all_single, CommType::broadcast,
                CommType::scatter, CommType::send, CommType::recv})
            mine.push_back(count(counts, t));
          at::Tensor total = comm::all_reduce(at::tensor(mine, at::kLong), ReduceOp::Sum, pp_group);
          const int64_t tied_total = tied ? 2 : 0;
          EXPECT_EQ(total[6].item<int64_t>(), 2 * (pp - 1) * m + tied_total);
          EXPECT_EQ(total[7].item<int64_t>(), 2 * (pp - 1) * m + tied_total);
          // The whole model under the same TP plan (without SP), one step on a micro-batch.
          std::vector<int64_t> expected(8, 0);
          if (tp > 1) {
            Transformer whole(config);
            whole->to(at::kDouble);
            apply_tensor_parallel(*whole, mesh,
                                  {.sequence_parallel = false, .loss_parallel = true});
            auto tokens = at::randint(config.vocab_size, {kBatch / m, kSeq}, at::kLong);
            CommDebugMode debug;
            loss_and_backward(whole->forward(tokens), tokens);
            reduce_partial_grads(*whole);
            const auto whole_counts = debug.get_comm_counts();
            int k = 0;
            for (CommType t : {CommType::all_reduce, CommType::all_gather_into_tensor,
                               CommType::reduce_scatter_tensor, CommType::all_to_all_single,
                               CommType::broadcast, CommType::scatter})
              expected[k++] = m * count(whole_counts, t);
            EXPECT_GT(expected[0], 0);
          }
          for (int k = 0; k < 6; ++k) EXPECT_EQ(total[k].item<int64_t>(), expected[k]) << k;
        }
      }
    });
  }
}

// Stage 1 of 2 raises in the forward of micro-batch 1. Its message names that; stage 0,
// waiting to receive micro-batch 0's gradient from it, ends promptly naming its own stage, the
// receive and stage 1's failure.
TEST(LlamaPipeline, AStageThatRaisesEndsEveryRank) {
  SKIP_IN_MPI_JOB();
  for (Kind kind : {Kind::GPipe, Kind::OneFOneB}) {
    auto out = run_ranks_collect(
        2,
        [kind](int rank) {
          auto mesh = init_device_mesh("cpu", {2}, {"pp"});
          const auto config = tiny(false);
          Transformer whole(config);
          whole->to(at::kDouble);
          auto stage = split_llama_stage(*whole, mesh);
          int calls = 0;
          pp::PipelineStage pipe(
              [&](const at::Tensor& x) {
                if (rank == 1 && ++calls == 2) TORCH_CHECK(false, "injected failure");
                return stage->forward(x);
              },
              mesh);
          auto schedule = make_schedule(kind, pipe, 2);
          auto tokens = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
          try {
            schedule->step(tokens, tokens);
          } catch (...) {
            // The failed stage lingers (its connections stay open): stage 0 must end on the
            // failure report, not on a broken connection.
            if (rank == 1) std::this_thread::sleep_for(std::chrono::seconds(8));
            throw;
          }
        },
        {.timeout = std::chrono::seconds(60), .comm_timeout = std::chrono::seconds(20)});
    ASSERT_EQ(out.size(), 2u);
    for (const auto& o : out) {
      EXPECT_FALSE(o.hung) << o.message;
      EXPECT_FALSE(WIFEXITED(o.status) && WEXITSTATUS(o.status) == 0) << o.message;
    }
    EXPECT_CONTAINS(out[1].message, "pipeline stage 1 of 2 (rank 1), forward of micro-batch 1");
    EXPECT_CONTAINS(out[1].message, "injected failure");
    // Stage 0 waits for a gradient from stage 1 (the channel 1->0 of the pp group): GPipe's
    // stage 1 failed before any backward, so micro-batch 0's; 1F1B's ran F0 B0 before F1, so
    // micro-batch 1's.
    EXPECT_CONTAINS(out[0].message, std::string("pipeline stage 0 of 2 (rank 0), backward of ") +
                                        (kind == Kind::GPipe ? "micro-batch 0" : "micro-batch 1"));
    EXPECT_CONTAINS(out[0].message, ":1->0");
    EXPECT_CONTAINS(out[0].message, "rank 1 failed");
    EXPECT_CONTAINS(out[0].message, "injected failure");
    // Promptly: well within the 20 s timeout, and long before stage 1 exits (a margin that a
    // loaded CI machine's scheduling delays do not eat).
    EXPECT_LT(out[0].seconds, out[1].seconds - 4.0) << out[0].message;
  }
}
