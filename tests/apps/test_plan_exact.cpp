// dtensor_plan's simulation is exact, not estimated: on every rank of a real run over Gloo, the
// collectives of a steady-state training step (CommDebugMode's records: op, bytes, mesh dim,
// group size, module, phase) equal, collective for collective, those of the same rank simulated
// on meta tensors in a recording world; the parameter, gradient and AdamW bytes are equal, and
// the step's memory peak above its start is within 10% (CPU allocator vs the meta allocator).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "common/options.h"
#include "common/run_config.h"
#include "dtensor/comm/process_group.h"
#include "plan/simulate.h"
#include "support/distributed.h"

using namespace dtensor;

namespace {

using Key = std::tuple<int, int64_t, int, int, std::string, bool, std::string>;

// The step's collectives as a multiset: the order of collectives on different groups is not
// fixed (asynchronous FSDP gathers), their set is.
std::map<Key, int64_t> multiset(const plan::StepRecord& s) {
  std::map<Key, int64_t> m;
  for (const auto& c : s.collectives) {
    const auto& r = c.record;
    ++m[{static_cast<int>(r.type), r.bytes, r.mesh_dim, r.group_size, r.module, r.backward,
         c.phase}];
  }
  return m;
}

std::string show(const std::map<Key, int64_t>& m) {
  std::string s;
  for (const auto& [k, n] : m) {
    s += "  " + std::to_string(n) + " x " + comm_type_name(static_cast<CommType>(std::get<0>(k))) +
         " " + std::to_string(std::get<1>(k)) + " B dim " + std::to_string(std::get<2>(k)) +
         " of " + std::to_string(std::get<3>(k)) + " '" + std::get<4>(k) + "' " +
         (std::get<5>(k) ? "bwd " : "fwd ") + std::get<6>(k) + "\n";
  }
  return s;
}

train::TrainOptions tiny(std::initializer_list<std::pair<std::string, int64_t>> layout,
                         const std::string& ac = "none") {
  train::TrainOptions o;
  o.preset = "tiny";
  o.layers = 4;
  o.batch_size = 8;
  o.ac = ac;
  for (const auto& [k, v] : layout) {
    if (k == "dp") o.dp = v;
    if (k == "dp_shard") o.dp_shard = v;
    if (k == "pp") o.pp = v;
    if (k == "microbatches") o.microbatches = v;
  }
  return o;
}

// Runs a real step and the simulated one on every rank of `world` and compares them.
void expect_simulation_exact(const train::TrainOptions& options, int world,
                             const std::string& schedule = "") {
  train::TrainOptions o = options;
  if (!schedule.empty()) o.schedule = schedule;
  const train::RunConfig config = train::resolve_run_config(o, world);
  dtensor::testing::run_ranks(world, [&](int rank) {
    plan::StepRecord real;
    {
      plan::CountingAllocator& cpu = plan::CountingAllocator::of(c10::DeviceType::CPU);
      const DeviceMesh mesh = train::make_train_mesh(config);
      train::Trainer trainer(config, mesh);
      at::manual_seed(7);
      const train::Batch batch{at::randint(256, {config.batch_size, config.seq_len}, at::kLong),
                               at::randint(256, {config.batch_size, config.seq_len}, at::kLong)};
      plan::record_step(trainer, batch, cpu);  // step 1: shapes, AdamW moments, FSDP order
      cpu.set_origin();
      real = plan::record_step(trainer, batch, cpu);
      comm::barrier();
    }
    comm::destroy_process_group();

    plan::RankClass me{rank, {}, "rank " + std::to_string(rank)};
    const plan::RankResult sim = plan::simulate_rank(config, me);
    const auto a = multiset(real), b = multiset(sim.step);
    EXPECT_EQ(a, b) << "rank " << rank << " real:\n" << show(a) << "simulated:\n" << show(b);
    EXPECT_EQ(real.collectives.size(), sim.step.collectives.size());
    EXPECT_GT(real.collectives.size(), 0u);
    EXPECT_EQ(real.state.parameters, sim.step.state.parameters);
    EXPECT_EQ(real.state.gradients, sim.step.state.gradients);
    EXPECT_EQ(real.state.optimizer, sim.step.state.optimizer);
    EXPECT_GT(sim.step.state.optimizer, 0);
    // Real: the CPU allocator from the step's start; simulated: the meta allocator's.
    const double real_peak = static_cast<double>(real.peak_bytes() - real.start_bytes);
    const double sim_peak = static_cast<double>(sim.step.peak_bytes() - sim.step.start_bytes);
    EXPECT_NEAR(sim_peak, real_peak, 0.10 * real_peak)
        << "rank " << rank << ": step peak above its start, real " << real_peak
        << " B vs simulated " << sim_peak << " B";
    // The recording backend saw every collective of a group larger than one rank.
    int64_t multi = 0;
    for (const auto& c : sim.step.collectives) multi += c.record.group_size > 1;
    EXPECT_EQ(static_cast<int64_t>(sim.backend_calls.size()), multi);
  });
}

}  // namespace

TEST(PlanExact, TensorParallel2) { expect_simulation_exact(tiny({}), 2); }

TEST(PlanExact, FullyShardedDataParallel2) { expect_simulation_exact(tiny({{"dp_shard", 2}}), 2); }

TEST(PlanExact, PlainDataParallel2) { expect_simulation_exact(tiny({{"dp", 2}}), 2); }

TEST(PlanExact, Pipeline2OneFOneB) {
  expect_simulation_exact(tiny({{"pp", 2}, {"microbatches", 4}}), 2, "1f1b");
}

TEST(PlanExact, Pipeline2GPipe) {
  expect_simulation_exact(tiny({{"pp", 2}, {"microbatches", 2}}), 2, "gpipe");
}

TEST(PlanExact, FsdpTimesTensorParallel4WithFullAc) {
  expect_simulation_exact(tiny({{"dp_shard", 2}}, "full"), 4);
}

TEST(PlanExact, PipelineTimesTensorParallel4) {
  expect_simulation_exact(tiny({{"pp", 2}, {"microbatches", 4}}), 4, "1f1b");
}

TEST(PlanExact, Pipeline4GPipeSelectiveAc) {
  expect_simulation_exact(tiny({{"pp", 4}, {"microbatches", 4}}, "selective"), 4, "gpipe");
}

TEST(PlanExact, FsdpTimesTensorParallel8) { expect_simulation_exact(tiny({{"dp_shard", 4}}), 8); }

TEST(PlanExact, PipelineTimesTensorParallel8) {
  expect_simulation_exact(tiny({{"pp", 4}, {"microbatches", 4}}), 8, "1f1b");
}

// AC whose recompute issues the TP collectives again: the plan sees the backward's extra ones.
TEST(PlanExact, PipelineTimesTensorParallel4FullAcRecomputingCollectives) {
  auto o = tiny({{"pp", 2}, {"microbatches", 2}}, "full");
  o.ac_recompute_collectives = true;
  expect_simulation_exact(o, 4, "1f1b");
}

// bf16 mixed precision inside pipeline stages: bfloat16 gathers and activations between stages,
// float32 reduce-scatters, on the real run and in the plan alike.
TEST(PlanExact, PipelineTimesFsdpTimesTensorParallel8Bf16) {
  auto o = tiny({{"pp", 2}, {"dp_shard", 2}, {"microbatches", 2}});
  o.mixed_precision = "bf16";
  expect_simulation_exact(o, 8, "1f1b");
}
