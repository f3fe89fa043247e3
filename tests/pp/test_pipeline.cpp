// Pipeline parallelism: point-to-point messages, the schedules' order, and the bundled Llama
// split into stages over a (pp, tp) mesh. For (pp, tp) = (2, 1), (4, 1) and (2, 2), GPipe and
// 1F1B with 1, 2 and 4 micro-batches, tied and untied embeddings, three AdamW steps give the
// same loss, every gradient and every parameter as the whole model on one device from the same
// seed (float64, 1e-9); so does interleaved 1F1B (v = 2) at pp = 2 and 4 with M = 2 and 4,
// with and without AC. A step issues exactly 2 * (v * pp - 1) * M sends and as many receives
// per pp group (plus one of each per tied stage), and the TP collectives of the non-pipelined
// plan without sequence parallelism, M times. The interleaved order is deadlock-free and meets
// (pp - 1) / (v M + pp - 1) in a simulation. A stage that raises ends every rank naming the stage,
// the micro-batch and the message it waited for.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <tuple>

#include "dtensor/ac/checkpoint.h"
#include "dtensor/dtensor.h"
#include "dtensor/models/transformer_stage.h"
#include "dtensor/pp/pipeline.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/llama_stages.h"
#include "support/model_compare.h"
#include "support/mpi_job.h"
#include "support/rank_outcomes.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

constexpr int64_t kBatch = 4, kSeq = 8;

enum class Kind { GPipe, OneFOneB, Interleaved };
const char* kind_name(Kind k) {
  return k == Kind::GPipe ? " GPipe" : k == Kind::OneFOneB ? " 1F1B" : " interleaved";
}

DeviceMesh pp_tp_mesh(int64_t pp, int64_t tp) {
  if (tp == 1) return init_device_mesh("cpu", {pp}, {"pp"});
  return init_device_mesh("cpu", {pp, tp}, {"pp", "tp"});
}

// This rank's stages (v of them: one for GPipe and 1F1B) of the tiny Llama from seed 11,
// tensor-parallel when the mesh has a tp dim, checkpointed under `ac`, and their schedule.
struct Built : LlamaStages {
  void reduce_partial_grads() {
    for (auto& st : stages) tp::reduce_partial_grads(*st);
  }
};

Built build(const DeviceMesh& mesh, const DecoderConfig& config, Kind kind, int64_t m,
            bool ac = false) {
  Transformer whole(config);
  whole->to(at::kDouble);
  whole->init_weights(11);
  Built b;
  if (kind == Kind::Interleaved) {
    b.stages = split_transformer_stages(*whole, mesh, /*virtual_stages=*/2);
  } else {
    b.stages.push_back(split_transformer_stage(*whole, mesh));
  }
  std::vector<pp::PipelineStage*> ptrs;
  for (auto& st : b.stages) {
    if (mesh.ndim() > 1) apply_tensor_parallel(*st, mesh, {.loss_parallel = true});
    if (ac) ac::apply_ac<TransformerBlockImpl>(*st, ac::ACMode::full);
    b.pipes.push_back(make_pipeline_stage(st, mesh));
    ptrs.push_back(b.pipes.back().get());
  }
  auto loss = [](const at::Tensor& out, const at::Tensor& target) {
    return token_cross_entropy(out, target);
  };
  if (kind == Kind::GPipe) {
    b.schedule = std::make_unique<pp::ScheduleGPipe>(*ptrs[0], m, loss);
  } else if (kind == Kind::OneFOneB) {
    b.schedule = std::make_unique<pp::Schedule1F1B>(*ptrs[0], m, loss);
  } else {
    b.schedule = std::make_unique<pp::ScheduleInterleaved1F1B>(ptrs, m, loss);
  }
  return b;
}

void expect_training_matches(const DeviceMesh& mesh, const DecoderConfig& config, Kind kind,
                             int64_t m, bool ac = false) {
  Transformer ref(config);
  ref->to(at::kDouble);
  ref->init_weights(11);
  Built b = build(mesh, config, kind, m, ac);
  const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW ref_opt(ref->parameters(), opt), opt_stage(b.parameters(), opt);
  const auto ref_params = params_of(*ref), params = b.params();
  for (const auto& [name, p] : params) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(ref_params.count(name));
    EXPECT_TRUE(close_to_scale(whole(p), ref_params.at(name), 0.0));
  }
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Identical on every rank: run_ranks seeds each rank alike.
    auto tokens = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
    auto targets = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
    ref_opt.zero_grad();
    opt_stage.zero_grad();
    auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
    auto loss = b.schedule->step(tokens, targets);
    b.reduce_partial_grads();
    EXPECT_EQ(loss.defined(), b.holds_last());
    if (loss.defined()) {
      EXPECT_TRUE(close_to_scale(loss, ref_loss, 1e-9)) << "loss";
    }
    for (const auto& [name, p] : params) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_TRUE(close_to_scale(whole(p.grad()), ref_params.at(name).grad(), 1e-9)) << "gradient";
    }
    ref_opt.step();
    opt_stage.step();
    for (const auto& [name, p] : params) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(close_to_scale(whole(p), ref_params.at(name), 1e-9))
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
          SCOPED_TRACE("pp=" + std::to_string(pp) + " tp=" + std::to_string(tp) + kind_name(kind) +
                       " M=" + std::to_string(m) + (tied ? " tied" : " untied"));
          expect_training_matches(mesh, tiny_pipeline_llama(tied), kind, m);
        }
      }
    }
  });
}

// Interleaved 1F1B with v = 2: 2 pp stages of the model's blocks (one per stage at pp = 4 with
// 8 layers), M in {2, 4} (at pp = 4, M = 2 is one round shorter than pp), with and without AC.
void expect_interleaved_parity(int64_t pp, int64_t tp) {
  run_ranks(static_cast<int>(pp * tp), [pp, tp](int) {
    auto mesh = pp_tp_mesh(pp, tp);
    for (bool tied : {false, true}) {
      for (bool ac : {false, true}) {
        for (int64_t m : {2, 4}) {
          SCOPED_TRACE("pp=" + std::to_string(pp) + " tp=" + std::to_string(tp) +
                       " interleaved v=2 M=" + std::to_string(m) + (tied ? " tied" : " untied") +
                       (ac ? " AC" : ""));
          auto config = tiny_pipeline_llama(tied);
          config.n_layers = 2 * pp;
          expect_training_matches(mesh, config, Kind::Interleaved, m, ac);
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

TEST(PipelineSchedule, ActionsOfGPipe1F1BAndInterleaved) {
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
    // Interleaved, v = 2 (stages r and r + 4), M = 4: one round of 4 micro-batches per chunk;
    // rank r warms up with min(8, (v - 1) * 4 + 2 * (3 - r)) forwards.
    pp::PipelineStage early([](const at::Tensor& x) { return x; }, mesh, rank, 8);
    pp::PipelineStage late([](const at::Tensor& x) { return x; }, mesh, rank + 4, 8);
    pp::ScheduleInterleaved1F1B inter({&early, &late}, 4, loss);
    EXPECT_EQ(late.label(), "pipeline stage " + std::to_string(rank + 4) + " of 8");
    // A stage of a 4-stage pipeline does not join one of 8.
    EXPECT_CONTAINS(message_of([&] {
                      pp::ScheduleInterleaved1F1B({&stage, &late}, 4, loss);
                    }),
                    "must be stage " + std::to_string(rank + 4) + " of 4");
    const std::string all_forwards =
        "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 B0.1 B1.1 B2.1 B3.1 B0.0 B1.0 B2.0 B3.0";
    const std::vector<std::string> interleaved{
        all_forwards, all_forwards,
        "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 B2.1 B3.1 B0.0 B1.0 B2.0 B3.0",
        "F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 B0.0 B1.0 B2.0 B3.0"};
    EXPECT_EQ(pp::format_actions(inter.actions()), interleaved[rank]);
    EXPECT_NEAR(pp::bubble_fraction(4, 1, 4), 3.0 / 7, 1e-15);
    EXPECT_NEAR(pp::bubble_fraction(4, 2, 4), 3.0 / 11, 1e-15);
    // The placement is round-robin, and an interleaved schedule gets every stage of its rank.
    EXPECT_CONTAINS(message_of([&] {
                      pp::PipelineStage([](const at::Tensor& x) { return x; }, mesh, rank + 1, 8);
                    }),
                    "round-robin placement");
    EXPECT_CONTAINS(message_of([&] { pp::ScheduleInterleaved1F1B({&late}, 4, loss); }),
                    "must be stage " + std::to_string(rank) + " of 8");
    EXPECT_EQ(pp::stage_layer_range(10, rank, 4),
              (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 6}, {6, 8}, {8, 10}}[rank]));
  });
}

// Schedule::eval: forward passes only, through every stage in order (interleaved stages too),
// the last stage's logits equal to one device's; each boundary carries one shape message and one
// activation per micro-batch.
TEST(PipelineSchedule, EvalRunsTheForwardThroughEveryStage) {
  run_ranks(4, [](int) {
    auto mesh = pp_tp_mesh(2, 2);
    auto config = tiny_pipeline_llama(/*tied=*/false);
    Transformer ref(config);
    ref->to(at::kDouble);
    ref->init_weights(11);
    ref->eval();
    for (Kind kind : {Kind::OneFOneB, Kind::Interleaved}) {
      for (int64_t m : {1, 2}) {
        SCOPED_TRACE(std::string(kind_name(kind)) + " M=" + std::to_string(m));
        Built b = build(mesh, config, kind, /*m=*/2);
        for (auto& st : b.stages) st->eval();
        auto tokens = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
        CommDebugMode comm;
        const at::Tensor out = b.schedule->eval(tokens, m);
        comm.exit();
        EXPECT_EQ(out.defined(), b.holds_last());
        if (out.defined()) {
          EXPECT_TRUE(close_to_scale(whole(out), ref->forward(tokens), 1e-12)) << "logits";
        }
        int64_t sends = 0, recvs = 0;
        for (const auto& pipe : b.pipes) {
          sends += pipe->is_last() ? 0 : 1 + m;
          recvs += pipe->is_first() ? 0 : 1 + m;
        }
        EXPECT_EQ(count(comm.get_comm_counts(), CommType::send), sends);
        EXPECT_EQ(count(comm.get_comm_counts(), CommType::recv), recvs);
      }
    }
  });
}

// pp = 2, v = 2, M = 4: two rounds of 2 micro-batches; the backwards run the chunks in
// reverse (the last stage's chunk first).
TEST(PipelineSchedule, InterleavedRunsRoundsOfMicroBatchesThroughTheChunks) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2}, {"pp"});
    auto id = [](const at::Tensor& x) { return x; };
    pp::PipelineStage early(id, mesh, rank, 4), late(id, mesh, rank + 2, 4);
    auto loss = [](const at::Tensor& out, const at::Tensor&) { return out.sum(); };
    pp::ScheduleInterleaved1F1B inter({&early, &late}, 4, loss);
    const std::vector<std::string> expected{
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"};
    EXPECT_EQ(pp::format_actions(inter.actions()), expected[rank]);
    EXPECT_CONTAINS(message_of([&] {
                      pp::ScheduleInterleaved1F1B({&early, &late}, 5, loss);
                    }),
                    "do not split into 2 rounds");
  });
}

// The action hook sees every action of this rank in the order the schedule runs them (backwards
// included); the last stage reports each micro-batch's loss in micro-batch order, the others none.
TEST(PipelineSchedule, TheActionHookSeesEachActionAndTheLastStageKeepsTheMicroBatchLosses) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2}, {"pp"});
    pp::PipelineStage stage([](const at::Tensor& x) { return x * 2; }, mesh);
    pp::Schedule1F1B schedule(stage, 4, [](const at::Tensor& out, const at::Tensor& target) {
      return (out - target).pow(2).mean();
    });
    std::vector<pp::Action> seen;
    schedule.set_action_hook([&](const pp::Action& a) { seen.push_back(a); });
    const at::Tensor inputs = at::arange(8, at::kFloat).view({4, 2}).requires_grad_(true);
    const at::Tensor targets = at::zeros({4, 2});
    const at::Tensor loss = schedule.step(inputs, targets);
    EXPECT_EQ(pp::format_actions(seen), pp::format_actions(schedule.actions()));
    const auto& losses = schedule.microbatch_losses();
    if (rank == 0) {
      EXPECT_TRUE(losses.empty());
      return;
    }
    ASSERT_EQ(losses.size(), 4u);
    for (int64_t i = 0; i < 4; ++i) {  // micro-batch i holds inputs 2i, 2i + 1, times 4 (2 stages)
      const double a = 4.0 * (2 * i), b = 4.0 * (2 * i + 1);
      EXPECT_DOUBLE_EQ(losses[i].item<double>(), (a * a + b * b) / 2) << "micro-batch " << i;
    }
    EXPECT_TRUE(at::equal(loss, at::stack(losses).mean()));
  });
}

// Every rank runs its interleaved list in order, each action waiting for the one it receives
// from (the previous stage's forward, the next stage's backward, on the last stage its own
// forward); with unit-time forwards and 2-unit backwards the lists all finish (no rank waits on
// one that waits on it), and when pp divides M the step takes exactly the time the bubble
// formula gives: v M * 3 / (1 - (pp - 1) / (v M + pp - 1)).
TEST(PipelineSchedule, InterleavedIsDeadlockFreeAndMeetsTheBubbleFormula) {
  for (int64_t pp : {2, 3, 4, 8}) {
    for (int64_t v : {1, 2, 3, 4}) {
      for (int64_t m = 1; m <= 16; ++m) {
        if (m % std::max<int64_t>(1, m / pp) != 0) continue;
        SCOPED_TRACE("pp=" + std::to_string(pp) + " v=" + std::to_string(v) +
                     " M=" + std::to_string(m));
        const int64_t stages = v * pp;
        std::vector<std::vector<pp::Action>> lists;
        for (int64_t r = 0; r < pp; ++r) lists.push_back(pp::interleaved_1f1b_actions(pp, r, v, m));
        std::map<std::tuple<bool, int64_t, int64_t>, double> done;  // (backward, stage, mb)
        std::vector<size_t> next(pp, 0);
        std::vector<double> clock(pp, 0);
        for (bool moved = true; moved;) {
          moved = false;
          for (int64_t r = 0; r < pp; ++r) {
            while (next[r] < lists[r].size()) {
              const pp::Action& a = lists[r][next[r]];
              const int64_t g = a.chunk * pp + r;
              std::optional<std::tuple<bool, int64_t, int64_t>> dep;
              if (!a.backward && g > 0) dep = {{false, g - 1, a.microbatch}};
              if (a.backward)
                dep = {{g == stages - 1 ? false : true, g == stages - 1 ? g : g + 1, a.microbatch}};
              if (dep && !done.count(*dep)) break;
              clock[r] = std::max(clock[r], dep ? done[*dep] : 0.0) + (a.backward ? 2 : 1);
              done[{a.backward, g, a.microbatch}] = clock[r];
              ++next[r];
              moved = true;
            }
          }
        }
        for (int64_t r = 0; r < pp; ++r) ASSERT_EQ(next[r], lists[r].size()) << "rank " << r;
        EXPECT_EQ(static_cast<int64_t>(done.size()), 2 * stages * m);
        if (m % pp == 0) {
          const double step = *std::max_element(clock.begin(), clock.end());
          EXPECT_NEAR(1 - 3.0 * v * m / step, pp::bubble_fraction(pp, v, m), 1e-12);
        }
      }
    }
  }
}

TEST(TransformerPipeline, TrainingMatchesOneDevicePp2) { expect_parity_for_layout(2, 1); }
TEST(TransformerPipeline, TrainingMatchesOneDevicePp4) { expect_parity_for_layout(4, 1); }
TEST(TransformerPipeline, TrainingMatchesOneDevicePp2Tp2) { expect_parity_for_layout(2, 2); }
TEST(TransformerPipeline, InterleavedTrainingMatchesOneDevicePp2) {
  expect_interleaved_parity(2, 1);
}
TEST(TransformerPipeline, InterleavedTrainingMatchesOneDevicePp4) {
  expect_interleaved_parity(4, 1);
}

// Per step and pp group: 2 * (S - 1) * M sends and as many receives over S = v * pp stages
// (one activation forward and one gradient backward per boundary and micro-batch; v = 1 but
// for the interleaved schedule's 2), plus one send and one receive on each of the two stages
// holding a tied embedding; the first step sends each boundary's activation shape once more.
// Rank r runs v stages, of which the first (r = 0) has no previous and the last (r = pp - 1)
// no next one. The TP collectives summed over the stages are the whole model's (plan without
// sequence parallelism) M times.
TEST(TransformerPipeline, MessagesPerStepFollowTheFormula) {
  for (const auto& layout :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{2, 1, 4}, {4, 1, 2}, {2, 2, 2}}) {
    const int64_t pp = std::get<0>(layout), tp = std::get<1>(layout), m = std::get<2>(layout);
    run_ranks(static_cast<int>(pp * tp), [pp, tp, m](int) {
      auto mesh = pp_tp_mesh(pp, tp);
      for (bool tied : {false, true}) {
        for (Kind kind : {Kind::GPipe, Kind::OneFOneB, Kind::Interleaved}) {
          SCOPED_TRACE("pp=" + std::to_string(pp) + " tp=" + std::to_string(tp) +
                       " M=" + std::to_string(m) + kind_name(kind) + (tied ? " tied" : " untied"));
          auto config = tiny_pipeline_llama(tied);
          config.n_layers = 2 * pp;
          Built b = build(mesh, config, kind, m);
          const int64_t v = kind == Kind::Interleaved ? 2 : 1;
          const int64_t r = b.pipes[0]->pp_mesh().get_local_rank();
          const int64_t first = r == 0 ? 1 : 0, last = r == pp - 1 ? 1 : 0;
          const int64_t ties = tied ? first + last : 0;
          const int64_t messages = m * (2 * v - first - last) + ties;
          CommCounts counts;
          for (int step = 0; step < 2; ++step) {
            auto tokens = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
            auto targets = at::randint(config.vocab_size, {kBatch, kSeq}, at::kLong);
            CommDebugMode debug;
            b.schedule->step(tokens, targets);
            b.reduce_partial_grads();
            counts = debug.get_comm_counts();
            const int64_t shape_sends = step == 0 ? v - last : 0;
            const int64_t shape_recvs = step == 0 ? v - first : 0;
            EXPECT_EQ(count(counts, CommType::send), messages + shape_sends) << debug.table();
            EXPECT_EQ(count(counts, CommType::recv), messages + shape_recvs) << debug.table();
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
          EXPECT_EQ(total[6].item<int64_t>(), 2 * (v * pp - 1) * m + tied_total);
          EXPECT_EQ(total[7].item<int64_t>(), 2 * (v * pp - 1) * m + tied_total);
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
// receive and stage 1's failure. Interleaved (v = 2, stages 1 and 3 on rank 1): rank 1's second
// forward is stage 1's of micro-batch 1, which rank 0 waits for as stage 2's input.
TEST(TransformerPipeline, AStageThatRaisesEndsEveryRank) {
  SKIP_IN_MPI_JOB();
  for (Kind kind : {Kind::GPipe, Kind::OneFOneB, Kind::Interleaved}) {
    auto out = run_ranks_collect(
        2,
        [kind](int rank) {
          auto mesh = init_device_mesh("cpu", {2}, {"pp"});
          const auto config = tiny_pipeline_llama(false);
          Transformer whole(config);
          whole->to(at::kDouble);
          const int64_t v = kind == Kind::Interleaved ? 2 : 1;
          auto stages = split_transformer_stages(*whole, mesh, v);
          int calls = 0;
          std::vector<std::unique_ptr<pp::PipelineStage>> pipes;
          std::vector<pp::PipelineStage*> ptrs;
          for (auto& stage : stages) {
            pipes.push_back(std::make_unique<pp::PipelineStage>(
                [&, stage](const at::Tensor& x) mutable {
                  if (rank == 1 && ++calls == 2) TORCH_CHECK(false, "injected failure");
                  return stage->forward(x);
                },
                mesh, stage->stage_index(), stage->num_stages()));
            ptrs.push_back(pipes.back().get());
          }
          auto loss = [](const at::Tensor& o, const at::Tensor& t) {
            return token_cross_entropy(o, t);
          };
          std::unique_ptr<pp::Schedule> schedule;
          if (kind == Kind::GPipe)
            schedule = std::make_unique<pp::ScheduleGPipe>(*ptrs[0], 2, loss);
          if (kind == Kind::OneFOneB)
            schedule = std::make_unique<pp::Schedule1F1B>(*ptrs[0], 2, loss);
          if (kind == Kind::Interleaved)
            schedule = std::make_unique<pp::ScheduleInterleaved1F1B>(ptrs, 2, loss);
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
    const bool interleaved = kind == Kind::Interleaved;
    EXPECT_CONTAINS(out[1].message, std::string("pipeline stage 1 of ") +
                                        (interleaved ? "4" : "2") +
                                        " (rank 1), forward of micro-batch 1");
    EXPECT_CONTAINS(out[1].message, "injected failure");
    // Stage 0 waits for a gradient from stage 1 (the channel 1->0 of the pp group): GPipe's
    // stage 1 failed before any backward, so micro-batch 0's; 1F1B's ran F0 B0 before F1, so
    // micro-batch 1's, or 0's when rank 1's non-blocking send of B0's gradient had not gone out
    // before it failed (both seen on a busy machine). Interleaved: stage 2 waits for an
    // activation, micro-batch 1's, or 0's for the same reason.
    EXPECT_CONTAINS(out[0].message,
                    interleaved ? std::string("pipeline stage 2 of 4 (rank 0), forward of "
                                              "micro-batch ")
                                : std::string("pipeline stage 0 of 2 (rank 0), backward of ") +
                                      (kind == Kind::GPipe ? "micro-batch 0" : "micro-batch "));
    EXPECT_CONTAINS(out[0].message, ":1->0");
    EXPECT_CONTAINS(out[0].message, "rank 1 failed");
    EXPECT_CONTAINS(out[0].message, "injected failure");
    // Promptly: well within the 20 s timeout, and long before stage 1 exits (a margin that a
    // loaded CI machine's scheduling delays do not eat).
    EXPECT_LT(out[0].seconds, out[1].seconds - 4.0) << out[0].message;
  }
}
