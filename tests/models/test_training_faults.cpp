// Faults at seeded random points of a tensor-parallel training step of the bundled Llama
// (TP=2): when a random module's forward starts, or when a random parameter's gradient
// arrives in backward, rank 1 throws, dies (SIGKILL) or stops (SIGSTOP). Rank 0, waiting in
// one of the step's collectives, must end within 2 s of rank 1's failure naming rank 1, or,
// for a stopped rank, within the timeout: never hang.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>

#include "dtensor/dtensor.h"
#include "dtensor/models/transformer.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/rank_outcomes.h"

using namespace dtensor;
using namespace dtensor::models;
using dtensor::testing::describe_outcomes;
using dtensor::testing::RankOutcome;
using dtensor::testing::run_ranks_collect;

namespace {

constexpr double kTimeout = 3.0;  // comm timeout, seconds
constexpr double kStopped = 8.0;  // how long a stopped rank stays stopped, seconds
const dtensor::testing::RunOptions kOpts{.timeout = std::chrono::seconds(30),
                                         .comm_timeout = std::chrono::seconds(3)};

enum class Fault { Throw, Kill, Stop };

struct Point {
  Fault fault;
  bool backward;      // at a parameter's gradient, else at a module's forward
  int step;           // training step (0-based) at which it happens
  std::string where;  // module path or parameter name
};

std::string describe(const std::vector<RankOutcome>& out, const Point& p) {
  std::ostringstream o;
  o << "fault at step " << p.step << (p.backward ? ", gradient of " : ", forward of ") << p.where
    << "\n"
    << describe_outcomes(out);
  return o.str();
}

Transformer make_model(const DeviceMesh& mesh) {
  auto c = DecoderConfig::preset("tiny");
  c.vocab_size = 64;
  Transformer model(c);
  apply_tensor_parallel(*model, mesh);
  return model;
}

void fail(Fault f) {
  if (f == Fault::Throw) TORCH_CHECK(false, "injected failure");
  if (f == Fault::Kill) ::raise(SIGKILL);
  if (::fork() == 0) {  // wakes the stopped rank up again later
    ::usleep(static_cast<useconds_t>(kStopped * 1e6));
    ::kill(::getppid(), SIGCONT);
    ::_exit(0);
  }
  ::raise(SIGSTOP);
}

// Three training steps; rank 1 meets the fault at `p`.
void train(int rank, const Point& p) {
  auto mesh = init_device_mesh("cpu", {2}, {"tp"});
  at::manual_seed(0);
  Transformer model = make_model(mesh);
  int step = 0;
  if (rank == 1 && !p.backward) {
    for (const auto& item : model->named_modules()) {
      if (item.key() != p.where) continue;
      auto* hooked = dynamic_cast<tp::HookedModule*>(item.value().get());
      TORCH_CHECK(hooked, p.where, " has no hooks");
      hooked->register_forward_pre_hook([&step, p](torch::nn::Module&, tp::ModuleCall&) {
        if (step == p.step) fail(p.fault);
      });
    }
  }
  if (rank == 1 && p.backward) {
    model->named_parameters()[p.where].register_hook([&step, p](const at::Tensor& g) {
      if (step == p.step) fail(p.fault);
      return g;
    });
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  for (step = 0; step < 3; ++step) {
    auto tokens = at::randint(64, {2, 8}, at::kLong);
    auto targets = at::randint(64, {2, 8}, at::kLong);
    opt.zero_grad();
    auto loss = token_cross_entropy(model->forward(tokens), targets);
    loss.backward();
    tp::reduce_partial_grads(*model);
    opt.step();
  }
}

// Fault points drawn from a fixed seed over the model's hooked modules and parameters.
std::vector<Point> draw_points() {
  auto mesh_free = [] {
    auto c = DecoderConfig::preset("tiny");
    c.vocab_size = 64;
    return Transformer(c);
  }();
  std::vector<std::string> modules, params;
  for (const auto& item : mesh_free->named_modules()) {
    if (!item.key().empty() && dynamic_cast<tp::HookedModule*>(item.value().get()))
      modules.push_back(item.key());
  }
  for (const auto& p : mesh_free->named_parameters()) params.push_back(p.key());
  std::mt19937 gen(2026);
  auto pick = [&](const std::vector<std::string>& v) { return v[gen() % v.size()]; };
  std::vector<Point> points;
  for (Fault f : {Fault::Throw, Fault::Kill}) {
    for (bool backward : {false, true}) {
      points.push_back(
          {f, backward, static_cast<int>(gen() % 3), pick(backward ? params : modules)});
    }
  }
  points.push_back({Fault::Stop, false, static_cast<int>(gen() % 3), pick(modules)});
  return points;
}

}  // namespace

TEST(TrainingFaults, EveryRankEndsPromptlyNamingTheFailedRank) {
  const auto points = draw_points();
  ASSERT_EQ(points.size(), 5u);
  for (const auto& p : points) {
    auto out = run_ranks_collect(
        2, [&p](int rank) { train(rank, p); }, kOpts);
    const std::string what = describe(out, p);
    if (std::getenv("DTENSOR_TEST_TRACE")) std::fprintf(stderr, "%s", what.c_str());
    ASSERT_EQ(out.size(), 2u);
    EXPECT_FALSE(out[0].hung) << what;
    EXPECT_FALSE(out[1].hung) << what;
    EXPECT_FALSE(WIFEXITED(out[0].status) && WEXITSTATUS(out[0].status) == 0) << what;
    EXPECT_CONTAINS(out[0].message, "rank 1");
    if (p.fault == Fault::Stop) {
      // Rank 0 gives up within the timeout, long before rank 1 is continued.
      EXPECT_LT(out[0].seconds, out[1].seconds - (kStopped - kTimeout - 1.5)) << what;
    } else {
      EXPECT_LT(out[0].seconds - out[1].seconds, 2.0) << what;
    }
    if (p.fault == Fault::Throw) {
      EXPECT_CONTAINS(out[0].message, "injected failure");
    }
  }
}
