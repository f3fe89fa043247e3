// fully_shard on the Llama model: with every TransformerBlock and the root sharded over dp, three
// AdamW steps on each rank's slice of the batch give the loss, the gradients and the parameters
// of one device training on the whole batch, with and without reshard_after_forward and
// activation checkpointing; each unit issues exactly one all-gather in forward, one more in
// backward with reshard_after_forward, and one reduce-scatter (checkpointing adds none); the
// gathered parameters' storage is empty between forward and backward with
// reshard_after_forward and after backward always; bad meshes and unsupported parameters are
// refused clearly.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/models/transformer.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/memory.h"
#include "support/model_compare.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;

namespace {

DecoderConfig tiny() {
  auto c = DecoderConfig::preset("tiny");
  c.vocab_size = 66;  // 66 rows split unevenly over 4 ranks (17, 17, 17, 15)
  return c;
}

// A float64 model with the weights every test starts from.
Transformer make_model(const DecoderConfig& config) {
  Transformer m(config);
  m->to(at::kDouble);
  m->init_weights(11);
  return m;
}

struct ShardSetup {
  bool reshard_after_forward = false;
  bool ac = false;  // full activation checkpointing of every block, applied before fully_shard
  std::string str() const {
    return std::string("reshard_after_forward=") + (reshard_after_forward ? "true" : "false") +
           " ac=" + (ac ? "full" : "none");
  }
};

void shard_model(TransformerImpl& model, const DeviceMesh& dp_mesh, ShardSetup setup = {}) {
  if (setup.ac) ac::apply_ac<TransformerBlockImpl>(model, ac::ACMode::full);
  const fsdp::FullyShardOptions opts{setup.reshard_after_forward};
  for (TransformerBlockImpl* block : model.blocks()) fsdp::fully_shard(*block, dp_mesh, opts);
  fsdp::fully_shard(model, dp_mesh, opts);
}

// The parameters every module with parameters of its own runs on (while its unit runs: the
// gathered ones), appended on each call, recomputes included.
std::shared_ptr<std::vector<at::Tensor>> record_parameters_in_use(TransformerImpl& model) {
  auto used = std::make_shared<std::vector<at::Tensor>>();
  for (const auto& m : model.modules(/*include_self=*/true)) {
    auto* h = dynamic_cast<tp::HookedModule*>(m.get());
    if (h == nullptr || m->named_parameters(/*recurse=*/false).is_empty()) continue;
    h->register_forward_pre_hook([used](torch::nn::Module& mod, tp::ModuleCall&) {
      for (const auto& p : mod.named_parameters(/*recurse=*/false)) used->push_back(p.value());
    });
  }
  return used;
}

int64_t count_of(const std::map<CommType, int64_t>& counts, CommType type) {
  auto it = counts.find(type);
  return it == counts.end() ? 0 : it->second;
}

void expect_training_matches(const DeviceMesh& mesh, ShardSetup setup,
                             const DecoderConfig& config = tiny()) {
  SCOPED_TRACE("dp=" + std::to_string(mesh.size()) + " " + setup.str() +
               (config.tie_embeddings ? " tied" : ""));
  const int64_t dp = mesh.size();
  const int64_t rank = mesh.get_local_rank();
  Transformer ref = make_model(config), model = make_model(config);
  shard_model(*model, mesh, setup);
  const auto in_use = record_parameters_in_use(*model);
  const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW ref_opt(ref->parameters(), opt), dp_opt(model->parameters(), opt);

  const auto ref_params = params_of(*ref), dp_params = params_of(*model);
  ASSERT_EQ(ref_params.size(), dp_params.size());
  // This rank's rows of the one-device tensor `full` for shard `p`.
  auto rows_of = [](const at::Tensor& full, const at::Tensor& p) {
    return full.narrow(0, fsdp::shard_info(p).row_offset, local_of(p).size(0));
  };
  for (const auto& [name, p] : dp_params) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(fsdp::is_fsdp_shard(p));
    EXPECT_TRUE(p.is_leaf());
    EXPECT_EQ(fsdp::shard_info(p).full_rows, ref_params.at(name).size(0));
    EXPECT_TRUE(close_to_scale(local_of(p), rows_of(ref_params.at(name), p), 0.0))
        << "initial value";
    // The leaf is a DTensor: Shard(0) over dp, whose global value is the parameter's.
    ASSERT_TRUE(is_dtensor(p));
    EXPECT_EQ(placements(p), Placements{Shard(0)});
    EXPECT_TRUE(close_to_scale(full_tensor(p.detach()), ref_params.at(name), 0.0));
  }
  const int64_t units = config.n_layers + 1;
  size_t block_params = 0;  // recomputed in backward with activation checkpointing
  for (const auto& [name, p] : dp_params) block_params += name.rfind("layers.", 0) == 0;
  const int64_t b = 2;  // sequences per rank
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // The same global batch on every rank (run_ranks seeds ranks alike); each takes its slice.
    auto tokens = at::randint(config.vocab_size, {b * dp, 8}, at::kLong);
    auto targets = at::randint(config.vocab_size, {b * dp, 8}, at::kLong);
    ref_opt.zero_grad();
    dp_opt.zero_grad();
    auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
    at::Tensor loss;
    in_use->clear();
    {
      CommDebugMode comm;
      auto logits = model->forward(tokens.narrow(0, b * rank, b));
      // Between forward and backward: the gathered parameters hold memory only without
      // reshard_after_forward.
      ASSERT_EQ(in_use->size(), dp_params.size());
      for (const at::Tensor& p : *in_use) {
        EXPECT_FALSE(fsdp::is_fsdp_shard(p)) << "a module ran on its shard";
        if (setup.reshard_after_forward)
          EXPECT_EQ(p.storage().nbytes(), 0u) << "gathered parameter " << p.sizes() << " kept";
        else  // padded to dp equal chunks of rows
          EXPECT_GE(p.storage().nbytes(), p.numel() * sizeof(double)) << p.sizes();
      }
      loss = loss_and_backward(logits, targets.narrow(0, b * rank, b));
      comm.exit();
      const auto counts = comm.get_comm_counts();
      const int64_t gathers = setup.reshard_after_forward ? 2 * units : units;
      EXPECT_EQ(comm.get_total_counts(), gathers + units) << format_comm_counts(counts);
      EXPECT_EQ(count_of(counts, CommType::all_gather_into_tensor), gathers);
      EXPECT_EQ(count_of(counts, CommType::reduce_scatter_tensor), units);
    }
    // After backward every gathered parameter (recomputes' included) is freed.
    EXPECT_EQ(in_use->size(), dp_params.size() + (setup.ac ? block_params : 0));
    for (const at::Tensor& p : *in_use) EXPECT_EQ(p.storage().nbytes(), 0u) << p.sizes();
    // Equal slices: the whole batch's mean loss is the mean of the ranks' losses.
    auto mean_loss = comm::all_reduce(loss.detach(), ReduceOp::Sum, mesh.group(0)) / dp;
    EXPECT_TRUE(close_to_scale(mean_loss, ref_loss, 1e-9)) << "loss";
    for (const auto& [name, p] : dp_params) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_TRUE(close_to_scale(local_of(p.grad()), rows_of(ref_params.at(name).grad(), p), 1e-9))
          << "gradient";
    }
    ref_opt.step();
    dp_opt.step();
    for (const auto& [name, p] : dp_params) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(close_to_scale(local_of(p), rows_of(ref_params.at(name), p), 1e-9))
          << "parameter";
    }
  }
}

void expect_training_matches_all(int64_t dp) {
  auto mesh = init_device_mesh("cpu", {dp}, {"dp"});
  for (bool reshard : {false, true})
    for (bool ac : {false, true}) expect_training_matches(mesh, ShardSetup{reshard, ac});
}

// Gradient accumulation over M = 2 micro-batches with set_requires_gradient_sync(false) for
// the first: per unit and step exactly 1 all-gather (the first forward's; the second forward and
// every regather reuse the kept parameters) and 1 reduce-scatter (the last backward's), with
// or without reshard_after_forward and AC; the shards' .grad stay undefined until then; and two
// steps of AdamW give the one-device parameters. Without deferral: M (2M with reshard) of each.
TEST(FullyShard, DeferredGradientSyncGathersAndReduceScattersOncePerStep) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    const auto config = tiny();
    const int64_t units = config.n_layers + 1, m = 2, b = 2;
    for (bool defer : {true, false}) {
      for (ShardSetup setup : {ShardSetup{false, false}, ShardSetup{true, true}}) {
        SCOPED_TRACE(setup.str() + (defer ? " deferred" : " every micro-batch"));
        Transformer ref = make_model(config), model = make_model(config);
        shard_model(*model, mesh, setup);
        const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
        torch::optim::AdamW ref_opt(ref->parameters(), opt), dp_opt(model->parameters(), opt);
        const auto ref_params = params_of(*ref), dp_params = params_of(*model);
        for (int step = 0; step < 2; ++step) {
          auto tokens = at::randint(config.vocab_size, {b * 2, 8}, at::kLong);
          auto targets = at::randint(config.vocab_size, {b * 2, 8}, at::kLong);
          ref_opt.zero_grad();
          dp_opt.zero_grad();
          loss_and_backward(ref->forward(tokens), targets);
          CommDebugMode comm;
          for (int64_t i = 0; i < m; ++i) {
            if (defer) {
              EXPECT_EQ(fsdp::set_requires_gradient_sync(*model, i == m - 1), units);
            }
            const int64_t row = b * rank + i * (b / m);
            auto logits = model->forward(tokens.narrow(0, row, b / m));
            at::Tensor loss = token_cross_entropy(logits, targets.narrow(0, row, b / m)) / m;
            loss.backward();
            if (defer && i < m - 1) {
              for (const auto& [name, p] : dp_params)
                EXPECT_FALSE(p.grad().defined()) << name << " reduced before the last micro-batch";
            }
          }
          comm.exit();
          const auto counts = comm.get_comm_counts();
          const int64_t per_mb = setup.reshard_after_forward ? 2 : 1;
          EXPECT_EQ(count_of(counts, CommType::all_gather_into_tensor),
                    defer ? units : m * per_mb * units)
              << format_comm_counts(counts);
          EXPECT_EQ(count_of(counts, CommType::reduce_scatter_tensor), defer ? units : m * units)
              << format_comm_counts(counts);
          for (const auto& [name, p] : dp_params) {
            SCOPED_TRACE(name);
            ASSERT_TRUE(p.grad().defined());
            EXPECT_TRUE(close_to_scale(local_of(p.grad()),
                                       ref_params.at(name).grad().narrow(
                                           0, fsdp::shard_info(p).row_offset, local_of(p).size(0)),
                                       1e-9))
                << "gradient";
          }
          ref_opt.step();
          dp_opt.step();
          for (const auto& [name, p] : dp_params)
            EXPECT_TRUE(close_to_scale(
                local_of(p),
                ref_params.at(name).narrow(0, fsdp::shard_info(p).row_offset, local_of(p).size(0)),
                1e-9))
                << name;
        }
      }
    }
  });
}

// A unit of one parameter with gradient sync off, forwarded again after a deferred backward (as
// a pipeline's first stage with its embedding alone in the root unit, when 1F1B runs a
// forward after a backward): the parameter gathered from the kept buffer must be a copy, since
// the backward empties the parameter's storage. It was a view of the whole buffer, and the
// second forward read an empty one ("setStorage: ... out of bounds for storage of size 0").
TEST(FullyShard, OneParameterUnitForwardsAgainAfterADeferredBackward) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    dtensor::nn::Linear ref(torch::nn::LinearOptions(4, 6).bias(false)),
        lin(torch::nn::LinearOptions(4, 6).bias(false));
    ref->to(at::kDouble);
    lin->to(at::kDouble);
    {
      at::NoGradGuard no_grad;
      lin->weight.copy_(ref->weight);
    }
    fsdp::fully_shard(*lin, mesh);
    ASSERT_EQ(fsdp::set_requires_gradient_sync(*lin, false), 1);
    auto x = at::randn({4, 4}, at::kDouble);  // two micro-batches of 1 row per rank
    ref->forward(x).pow(2).sum().backward();
    for (int64_t i = 0; i < 2; ++i) {
      if (i == 1) fsdp::set_requires_gradient_sync(*lin, true);
      lin->forward(x.narrow(0, 2 * rank + i, 1)).pow(2).sum().mul(2).backward();  // mean over dp
    }
    const at::Tensor& w = lin->weight;
    EXPECT_TRUE(
        close_to_scale(local_of(w.grad()), ref->weight.grad().narrow(0, 3 * rank, 3), 1e-12));
  });
}

// With gradient sync off, the forwards of a unit of one parameter share the kept all-gathered
// buffer: M micro-batches in flight hold one gathered weight, not M copies (a copy per forward
// cost Llama-3-405B's first pipeline stage 4 GiB more at 8 micro-batches).
TEST(FullyShard, DeferredForwardsOfAOneParameterUnitShareTheKeptBuffer) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    dtensor::nn::Linear lin(torch::nn::LinearOptions(512, 512).bias(false));
    lin->to(at::kDouble);
    fsdp::fully_shard(*lin, mesh);
    fsdp::set_requires_gradient_sync(*lin, false);
    const auto x = at::randn({1, 512}, at::kDouble);
    const int64_t weight_bytes = 512 * 512 * 8;
    std::vector<at::Tensor> in_flight;
    CountCpuBytes bytes;
    for (int i = 0; i < 4; ++i) in_flight.push_back(lin->forward(x));
    EXPECT_LT(bytes.live(), 2 * weight_bytes) << "4 forwards in flight";
    for (auto& y : in_flight) y.sum().backward();
  });
}

TEST(FullyShard, LlamaTrainingMatchesOneDeviceDp2) {
  run_ranks(2, [](int) { expect_training_matches_all(2); });
}

TEST(FullyShard, LlamaTrainingMatchesOneDeviceDp4) {
  run_ranks(4, [](int) { expect_training_matches_all(4); });
}

// A tied output head (Qwen's and Gemma's small checkpoints) computes with the embedding's
// gathered weight: one all-gather and one reduce-scatter for both uses, the gradient of both.
TEST(FullyShard, TiedEmbeddingTrainingMatchesOneDeviceDp2) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    auto config = tiny();
    config.tie_embeddings = true;
    for (bool reshard : {false, true}) expect_training_matches(mesh, ShardSetup{reshard}, config);
  });
}

// The graph of a forward holds what its backward needs (the unit's sharding and process group),
// so the model may be destroyed before backward: the gradients still reach the shards.
TEST(FullyShard, BackwardRunsAfterTheModelIsDestroyed) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    const int64_t rank = mesh.get_local_rank();
    const auto config = tiny();
    Transformer ref = make_model(config);
    auto tokens = at::randint(config.vocab_size, {4, 8}, at::kLong);
    auto targets = at::randint(config.vocab_size, {4, 8}, at::kLong);
    loss_and_backward(ref->forward(tokens), targets);
    Params shards;
    at::Tensor logits;
    {
      Transformer model = make_model(config);
      shard_model(*model, mesh);
      shards = params_of(*model);
      logits = model->forward(tokens.narrow(0, 2 * rank, 2));
    }
    loss_and_backward(logits, targets.narrow(0, 2 * rank, 2));
    const auto ref_params = params_of(*ref);
    for (const auto& [name, p] : shards) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(p.grad().defined());
      const at::Tensor expected =
          ref_params.at(name).grad().narrow(0, fsdp::shard_info(p).row_offset, local_of(p).size(0));
      EXPECT_TRUE(close_to_scale(local_of(p.grad()), expected, 1e-9));
    }
  });
}

TEST(FullyShard, RefusesBadMeshes) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    Transformer model(tiny());
    EXPECT_CONTAINS(message_of([&] { fsdp::fully_shard(*model, mesh); }),
                    "expected a 1-D data-parallel mesh");
    // TP on another mesh than the dp mesh's: the leaf's (tp, dp) mesh cannot be formed.
    auto other = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    Transformer tp_model(tiny());
    apply_tensor_parallel(*tp_model, other["tp"]);
    EXPECT_CONTAINS(message_of([&] { fsdp::fully_shard(*tp_model, mesh["dp"]); }),
                    "does not form one mesh");
  });
}

// FSDP over tensor parallelism on a (dp=2, tp=2) mesh: each parameter's tp-local tensor is
// sharded over dp; three AdamW steps match one device on the whole batch, with and without
// reshard_after_forward and activation checkpointing, and with a tied output head.
TEST(FullyShard, OverTensorParallelMatchesOneDeviceDp2Tp2) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const DeviceMesh dp_mesh = mesh["dp"], tp_mesh = mesh["tp"];
    const int64_t dp_rank = dp_mesh.get_local_rank();
    // The last case ties the output head to the embedding (both Shard(0) over tp, then dp).
    for (const auto& [setup, tied] :
         {std::pair{ShardSetup{false, false}, false}, std::pair{ShardSetup{true, true}, false},
          std::pair{ShardSetup{true, false}, true}}) {
      SCOPED_TRACE(setup.str() + (tied ? " tied" : ""));
      auto config = tiny();
      config.tie_embeddings = tied;
      Transformer ref = make_model(config), model = make_model(config);
      apply_tensor_parallel(*model, tp_mesh);
      std::map<std::string, DTensorSpec> tp_specs;
      for (const auto& [name, p] : params_of(*model)) tp_specs.emplace(name, spec_of(p));
      shard_model(*model, dp_mesh, setup);
      const auto opt = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
      torch::optim::AdamW ref_opt(ref->parameters(), opt), dp_opt(model->parameters(), opt);
      const auto ref_params = params_of(*ref), dp_params = params_of(*model);
      // This rank's rows of its tp-local part of the one-device tensor `full`.
      auto rows_of = [&](const std::string& name, const at::Tensor& full, const at::Tensor& p) {
        const DTensorSpec& s = tp_specs.at(name);
        const at::Tensor local =
            to_local(distribute_tensor(full.detach(), s.mesh(), s.placements()));
        return local.narrow(0, fsdp::shard_info(p).row_offset, local_of(p).size(0));
      };
      for (int step = 0; step < 3; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        auto tokens = at::randint(config.vocab_size, {4, 8}, at::kLong);
        auto targets = at::randint(config.vocab_size, {4, 8}, at::kLong);
        ref_opt.zero_grad();
        dp_opt.zero_grad();
        auto ref_loss = loss_and_backward(ref->forward(tokens), targets);
        auto loss = loss_and_backward(model->forward(tokens.narrow(0, 2 * dp_rank, 2)),
                                      targets.narrow(0, 2 * dp_rank, 2));
        if (is_dtensor(loss)) loss = full_tensor(loss);
        auto mean_loss = comm::all_reduce(loss.detach(), ReduceOp::Sum, dp_mesh.group(0)) / 2;
        EXPECT_TRUE(close_to_scale(mean_loss, ref_loss, 1e-9)) << "loss";
        for (const auto& [name, p] : dp_params) {
          SCOPED_TRACE(name);
          ASSERT_TRUE(fsdp::is_fsdp_shard(p));
          ASSERT_TRUE(p.grad().defined());
          EXPECT_TRUE(close_to_scale(local_of(p.grad()),
                                     rows_of(name, ref_params.at(name).grad(), p), 1e-9))
              << "gradient";
          // The leaf and its gradient are DTensors on (tp, dp): TP's placement, then Shard(0).
          Placements expected(tp_specs.at(name).placements().begin(),
                              tp_specs.at(name).placements().end());
          expected.push_back(Shard(0));
          EXPECT_EQ(placements(p), expected);
          EXPECT_EQ(device_mesh(p).dim_names(), (std::vector<std::string>{"tp", "dp"}));
          EXPECT_TRUE(close_to_scale(full_tensor(p.grad()), ref_params.at(name).grad(), 1e-9))
              << "whole gradient";
        }
        ref_opt.step();
        dp_opt.step();
        for (const auto& [name, p] : dp_params) {
          SCOPED_TRACE(name);
          EXPECT_TRUE(close_to_scale(local_of(p), rows_of(name, ref_params.at(name), p), 1e-9))
              << "parameter";
          EXPECT_TRUE(close_to_scale(full_tensor(p.detach()), ref_params.at(name), 1e-9))
              << "whole parameter";
        }
      }
    }
  });
}

}  // namespace

// A model sharded and dropped, then another: the new model's parameters are all sharded, even
// when they reuse the memory of the old shards (the shard registry must not mistake them for
// shards of a child unit and leave them whole).
TEST(FullyShard, ModelsShardedOneAfterAnotherAreEachShardedWhole) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    for (int round = 0; round < 8; ++round) {
      SCOPED_TRACE("round " + std::to_string(round));
      Transformer model(tiny());
      std::vector<int64_t> rows;
      for (const auto& p : model->parameters()) rows.push_back(p.size(0));
      shard_model(*model, mesh);
      size_t i = 0;
      for (const auto& p : model->parameters()) {
        ASSERT_TRUE(fsdp::is_fsdp_shard(p));
        EXPECT_EQ(fsdp::shard_info(p).full_rows, rows[i]);
        EXPECT_EQ(local_of(p).size(0),
                  (rows[i] + 1) / 2 - (mesh.get_local_rank() == 1 ? rows[i] % 2 : 0));
        ++i;
      }
    }
  });
}

// ---- memory ----

namespace {

// Bytes of the parameters, their gradients and AdamW's moments this rank holds.
int64_t state_bytes(const torch::nn::Module& model, torch::optim::AdamW& opt) {
  auto bytes = [](const at::Tensor& t) {  // what this rank holds (FSDP's leaves are DTensors)
    return t.defined() ? local_of(t).numel() * static_cast<int64_t>(t.element_size()) : 0;
  };
  int64_t total = 0;
  for (const at::Tensor& p : model.parameters()) {
    total += bytes(p) + bytes(p.grad());
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    total += bytes(s.exp_avg()) + bytes(s.exp_avg_sq()) + bytes(s.max_exp_avg_sq());
  }
  return total;
}

// The bytes of the gathered parameters held at once, sampled whenever a module with parameters
// starts (forward and recompute) and whenever a gradient for a gathered parameter is ready (its
// unit's backward). Holds storages only: a tensor here, reached from the gradient hooks on the
// tensor's own grad_fn, would make a cycle.
struct GatheredBytes {
  std::vector<c10::Storage> storages;  // each storage a module ran on, once
  int64_t peak = 0;

  int64_t now() const {
    int64_t total = 0;
    for (const auto& st : storages) total += static_cast<int64_t>(st.nbytes());
    return total;
  }
  void sample() { peak = std::max(peak, now()); }

  static std::shared_ptr<GatheredBytes> watch(TransformerImpl& model) {
    auto g = std::make_shared<GatheredBytes>();
    for (const auto& m : model.modules(/*include_self=*/true)) {
      auto* h = dynamic_cast<tp::HookedModule*>(m.get());
      if (h == nullptr || m->named_parameters(/*recurse=*/false).is_empty()) continue;
      h->register_forward_pre_hook([g](torch::nn::Module& mod, tp::ModuleCall&) {
        for (const auto& p : mod.named_parameters(/*recurse=*/false)) {
          const at::Tensor& t = p.value();
          auto* impl = t.storage().unsafeGetStorageImpl();
          if (std::none_of(g->storages.begin(), g->storages.end(), [&](const c10::Storage& st) {
                return st.unsafeGetStorageImpl() == impl;
              }))
            g->storages.push_back(t.storage());
          if (t.requires_grad()) t.register_hook([g](const at::Tensor&) { g->sample(); });
        }
        g->sample();
      });
    }
    return g;
  }
};

struct StepMemory {
  int64_t state = 0;                   // parameters + gradients + AdamW state after a step
  int64_t gathered_after_forward = 0;  // gathered parameters' bytes between forward and backward
  int64_t gathered_peak = 0;           // the most gathered parameter bytes held at once
  int64_t after_forward = 0;  // all CPU bytes the forward left (activations, gathered, ...)
  int64_t peak = 0;           // highest CPU bytes during forward + backward, above the start
};

// The tiny Llama with 4 blocks, so that one block is a small part of the model.
DecoderConfig memory_config() {
  auto config = tiny();
  config.n_layers = 4;
  config.max_seq_len = 32;
  return config;
}

// One AdamW step of a fresh 4-block tiny Llama (float64, B=2 sequences of 32 per rank),
// sharded over `mesh` unless it is null. The CPU byte counts include what the collectives'
// background threads still hold, so they vary a little between ranks and runs; the rest is
// exact.
StepMemory measure_step(const DeviceMesh* mesh, ShardSetup setup) {
  const auto config = memory_config();
  Transformer model = make_model(config);
  if (mesh) {
    shard_model(*model, *mesh, setup);
  } else if (setup.ac) {
    ac::apply_ac<TransformerBlockImpl>(*model, ac::ACMode::full);
  }
  auto gathered = mesh ? GatheredBytes::watch(*model) : nullptr;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  auto tokens = at::randint(config.vocab_size, {2, 32}, at::kLong);
  auto targets = at::randint(config.vocab_size, {2, 32}, at::kLong);
  StepMemory m;
  {
    CountCpuBytes bytes;
    auto loss = token_cross_entropy(model->forward(tokens), targets);
    m.after_forward = bytes.live();
    if (gathered) m.gathered_after_forward = gathered->now();
    loss.backward();
    m.peak = bytes.peak();
  }
  if (gathered) m.gathered_peak = gathered->peak;
  opt.step();
  m.state = state_bytes(*model, opt);
  return m;
}

void expect_memory_divided(int64_t dp) {
  auto mesh = init_device_mesh("cpu", {dp}, {"dp"});
  int64_t param_bytes = 0, largest_block = 0;  // of the whole model, of one block
  {
    Transformer model(memory_config());
    for (const auto& p : model->parameters()) param_bytes += p.numel() * 8;
    for (const auto& p : model->block(0).parameters()) largest_block += p.numel() * 8;
  }
  const StepMemory one = measure_step(nullptr, {});
  const std::vector<ShardSetup> setups = {
      {false, false}, {true, false}, {false, true}, {true, true}};
  std::vector<StepMemory> sharded;
  for (const ShardSetup& s : setups) sharded.push_back(measure_step(&mesh, s));
  // Parameters, gradients and AdamW state: 1/dp per rank, within 10% (uneven last rows).
  EXPECT_EQ(one.state, 4 * param_bytes);
  EXPECT_LE(static_cast<double>(sharded[0].state * dp), 1.1 * static_cast<double>(one.state));
  for (size_t i = 0; i < setups.size(); ++i) {
    SCOPED_TRACE(setups[i].str());
    EXPECT_EQ(sharded[i].state, sharded[0].state);
    if (setups[i].reshard_after_forward) {
      // Nothing gathered survives the forward; at most the root and one block at once (the
      // root's parameters are gathered again when backward starts).
      EXPECT_EQ(sharded[i].gathered_after_forward, 0);
      EXPECT_LE(sharded[i].gathered_peak,
                param_bytes - (memory_config().n_layers - 2) * largest_block + dp * 8 * 1024);
    } else {
      // Every unit's gathered parameters (padded to dp equal chunks) live until backward.
      EXPECT_GE(sharded[i].gathered_after_forward, param_bytes);
      EXPECT_EQ(sharded[i].gathered_peak, sharded[i].gathered_after_forward);
    }
  }
  if (mesh.get_local_rank() == 0) {
    std::cout << "dp=" << dp << " (rank 0): parameters+gradients+AdamW " << sharded[0].state
              << " B (one device " << one.state << " B, ratio "
              << static_cast<double>(one.state) / static_cast<double>(sharded[0].state)
              << "); one device without FSDP: after forward " << one.after_forward << " B, peak "
              << one.peak << " B\n";
    for (size_t i = 0; i < setups.size(); ++i)
      std::cout << "  " << setups[i].str() << ": gathered after forward "
                << sharded[i].gathered_after_forward << " B, gathered peak "
                << sharded[i].gathered_peak << " B; CPU after forward " << sharded[i].after_forward
                << " B, CPU peak " << sharded[i].peak << " B\n";
  }
}

}  // namespace

// Memory per rank: FSDP divides the parameters, gradients and optimizer state by dp, and
// reshard_after_forward frees the gathered parameters between forward and backward.
TEST(FullyShard, MemoryPerRankDp1) {
  run_ranks(1, [](int) { expect_memory_divided(1); });
}
TEST(FullyShard, MemoryPerRankDp2) {
  run_ranks(2, [](int) { expect_memory_divided(2); });
}
TEST(FullyShard, MemoryPerRankDp4) {
  run_ranks(4, [](int) { expect_memory_divided(4); });
}

// ---- prefetch ----

namespace {

int64_t count_records(const CommDebugMode& comm, CommType type, bool backward) {
  int64_t n = 0;
  for (const auto& r : comm.records()) n += r.type == type && r.backward == backward;
  return n;
}

struct PrefetchRun {
  std::vector<at::Tensor> losses;
  Params params;  // after the steps, with their gradients
  std::vector<std::vector<std::pair<CommType, int64_t>>> comms;  // per step: type, bytes, sorted
  // Per step and block: forward all-gathers issued when the block's body starts, and backward
  // all-gathers issued when the gradient reaches the block's output.
  std::vector<std::vector<int64_t>> gathers_at_forward, gathers_at_backward;
};

// Three AdamW steps of the tiny Llama with every block and the root fully_shard'ed with
// `prefetch`; counts the all-gathers issued when each block starts its forward and backward.
PrefetchRun run_prefetch(const DeviceMesh& mesh, bool prefetch, bool reshard) {
  const auto config = tiny();
  Transformer model = make_model(config);
  fsdp::FullyShardOptions opts{.reshard_after_forward = reshard, .prefetch = prefetch};
  for (TransformerBlockImpl* block : model->blocks()) fsdp::fully_shard(*block, mesh, opts);
  fsdp::fully_shard(*model, mesh, opts);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  PrefetchRun run;
  at::manual_seed(5);  // the same batches in every run
  CommDebugMode* active = nullptr;
  std::vector<int64_t>*at_forward = nullptr, *at_backward = nullptr;
  // Registered after fully_shard's hooks, so they run after them.
  for (size_t i = 0; i < model->layers->size(); ++i) {
    auto* h = dynamic_cast<tp::HookedModule*>(&model->block(static_cast<int64_t>(i)));
    h->register_forward_pre_hook([&, i](torch::nn::Module&, tp::ModuleCall&) {
      (*at_forward)[i] = count_records(*active, CommType::all_gather_into_tensor, false);
    });
    h->register_forward_hook([&, i](torch::nn::Module&, const tp::ModuleCall&, c10::IValue& out) {
      out.toTensor().register_hook([&, i](const at::Tensor&) {
        (*at_backward)[i] = count_records(*active, CommType::all_gather_into_tensor, true);
      });
    });
  }
  const int64_t rank = mesh.get_local_rank();
  for (int step = 0; step < 3; ++step) {
    auto tokens = at::randint(config.vocab_size, {2 * mesh.size(), 8}, at::kLong);
    auto targets = at::randint(config.vocab_size, {2 * mesh.size(), 8}, at::kLong);
    run.gathers_at_forward.emplace_back(config.n_layers, -1);
    run.gathers_at_backward.emplace_back(config.n_layers, -1);
    at_forward = &run.gathers_at_forward.back();
    at_backward = &run.gathers_at_backward.back();
    opt.zero_grad();
    CommDebugMode comm;
    active = &comm;
    run.losses.push_back(loss_and_backward(model->forward(tokens.narrow(0, 2 * rank, 2)),
                                           targets.narrow(0, 2 * rank, 2)));
    comm.exit();
    run.comms.emplace_back();
    for (const auto& r : comm.records()) run.comms.back().emplace_back(r.type, r.bytes);
    // Prefetch issues the same collectives, some earlier: compare them as a set.
    std::sort(run.comms.back().begin(), run.comms.back().end());
    opt.step();
  }
  for (const auto& [name, p] : params_of(*model)) {
    run.params.emplace(name, p.detach().clone());
    run.params.emplace(name + ".grad", p.grad().clone());
  }
  return run;
}

}  // namespace

// With prefetch, a block's forward all-gather is issued while the block before it starts (from
// the second step, once the order is known), and in backward the next block's gather while
// the gradient reaches this block; the collectives (how many of each type and size) and every
// bit of the results equal the run without prefetch.
TEST(FullyShard, PrefetchIssuesGathersAheadWithTheSameResults) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    const int64_t n = tiny().n_layers;
    for (bool reshard : {true, false}) {
      SCOPED_TRACE(reshard ? "reshard_after_forward" : "no reshard_after_forward");
      const PrefetchRun off = run_prefetch(mesh, false, reshard);
      const PrefetchRun on = run_prefetch(mesh, true, reshard);
      for (size_t s = 0; s < off.losses.size(); ++s) {
        SCOPED_TRACE("step " + std::to_string(s));
        EXPECT_TRUE(at::equal(on.losses[s], off.losses[s]));
        EXPECT_EQ(on.comms[s], off.comms[s]);
        for (int64_t i = 0; i < n; ++i) {
          SCOPED_TRACE("block " + std::to_string(i));
          // The root's gather, then blocks 0..i (and i + 1 when prefetched).
          EXPECT_EQ(off.gathers_at_forward[s][i], i + 2);
          const bool ahead = s > 0 && i + 1 < n;
          EXPECT_EQ(on.gathers_at_forward[s][i], i + 2 + (ahead ? 1 : 0));
          // Backward (reshard only): the root's regather, then blocks n-1..i (and i - 1).
          const int64_t back = reshard ? 1 + (n - i) : 0;
          EXPECT_EQ(off.gathers_at_backward[s][i], back);
          EXPECT_EQ(on.gathers_at_backward[s][i], back + (reshard && i > 0 ? 1 : 0));
        }
      }
      for (const auto& [name, t] : off.params) {
        SCOPED_TRACE(name);
        EXPECT_TRUE(at::equal(on.params.at(name), t));
      }
    }
  });
}

// ---- mixed precision ----

namespace {

struct PrecisionRun {
  std::vector<double> losses;
  Params params;
  std::vector<CommRecord> records;              // of the last step
  std::vector<at::ScalarType> gathered_dtypes;  // of the parameters the modules ran on
};

// Three AdamW steps of the float32 tiny Llama, fully_shard'ed with `opts`.
PrecisionRun run_precision(const DeviceMesh& mesh, fsdp::FullyShardOptions opts) {
  const auto config = tiny();
  Transformer model(config);
  model->init_weights(11);  // float32
  for (TransformerBlockImpl* block : model->blocks()) fsdp::fully_shard(*block, mesh, opts);
  fsdp::fully_shard(*model, mesh, opts);
  const auto in_use = record_parameters_in_use(*model);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  PrecisionRun run;
  at::manual_seed(5);  // the same batches in every run
  const int64_t rank = mesh.get_local_rank();
  for (int step = 0; step < 3; ++step) {
    auto tokens = at::randint(config.vocab_size, {4, 16}, at::kLong);
    auto targets = at::randint(config.vocab_size, {4, 16}, at::kLong);
    opt.zero_grad();
    CommDebugMode comm;
    auto logits = model->forward(tokens.narrow(0, 2 * rank, 2));
    auto loss = loss_and_backward(logits.to(at::kFloat), targets.narrow(0, 2 * rank, 2));
    comm.exit();
    run.losses.push_back(comm::all_reduce(loss, ReduceOp::Sum, mesh.group(0)).item<double>() /
                         mesh.size());
    run.records = comm.records();
    opt.step();
  }
  for (const at::Tensor& p : *in_use) run.gathered_dtypes.push_back(p.scalar_type());
  for (const auto& [name, p] : params_of(*model)) {
    EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
    EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << name;
    const auto& s =
        static_cast<const torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(s.exp_avg().scalar_type(), at::kFloat) << name;
    EXPECT_EQ(s.exp_avg_sq().scalar_type(), at::kFloat) << name;
    run.params.emplace(name, p.detach().clone());
  }
  return run;
}

int64_t count_records_of(const std::vector<CommRecord>& records, CommType type) {
  return std::count_if(records.begin(), records.end(),
                       [type](const CommRecord& r) { return r.type == type; });
}

int64_t bytes_of(const std::vector<CommRecord>& records, CommType type) {
  int64_t total = 0;
  for (const auto& r : records) total += r.type == type ? r.bytes : 0;
  return total;
}

}  // namespace

// param_dtype bf16 (reduce_dtype float32, or unset: bf16): the modules run on bfloat16
// parameters, the shards, their gradients and AdamW's moments stay float32, the collectives
// are the same ones with half the all-gathered bytes (and half the reduce-scattered ones when
// reducing in bf16), and three steps stay near the float32 run.
TEST(FullyShard, MixedPrecisionBf16GathersHalfTheBytesAndStaysNearFloat32) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    const PrecisionRun fp32 = run_precision(mesh, {.reshard_after_forward = true});
    for (auto reduce :
         {std::optional<at::ScalarType>(at::kFloat), std::optional<at::ScalarType>()}) {
      SCOPED_TRACE(reduce ? "reduce_dtype float32" : "reduce_dtype unset (bf16)");
      const PrecisionRun bf16 = run_precision(
          mesh,
          {.reshard_after_forward = true, .param_dtype = at::kBFloat16, .reduce_dtype = reduce});
      for (auto dt : fp32.gathered_dtypes) EXPECT_EQ(dt, at::kFloat);
      ASSERT_FALSE(bf16.gathered_dtypes.empty());
      for (auto dt : bf16.gathered_dtypes) EXPECT_EQ(dt, at::kBFloat16);
      ASSERT_EQ(bf16.records.size(), fp32.records.size());
      for (CommType t : {CommType::all_gather_into_tensor, CommType::reduce_scatter_tensor})
        EXPECT_EQ(count_records_of(bf16.records, t), count_records_of(fp32.records, t)) << t;
      const int64_t gathered = bytes_of(fp32.records, CommType::all_gather_into_tensor);
      EXPECT_GT(gathered, 0);
      EXPECT_EQ(2 * bytes_of(bf16.records, CommType::all_gather_into_tensor), gathered);
      const int64_t reduced = bytes_of(fp32.records, CommType::reduce_scatter_tensor);
      EXPECT_EQ(bytes_of(bf16.records, CommType::reduce_scatter_tensor) * (reduce ? 1 : 2),
                reduced);
      // bfloat16 keeps 8 significant bits (relative rounding 2^-9); the logits pass through a
      // few dozen rounded operations whose errors partly cancel, so the loss (about 4.2 = ln 66)
      // stays within 1%. AdamW moves each weight by at most lr per step whatever the gradient's
      // scale, so after 3 steps the weights differ by at most 2 * 3 * lr, and by far less on
      // average, where bf16 gradients keep the sign of the float32 ones.
      for (size_t s = 0; s < fp32.losses.size(); ++s)
        EXPECT_NEAR(bf16.losses[s], fp32.losses[s], 1e-2 * fp32.losses[s]) << "step " << s;
      for (const auto& [name, p] : fp32.params) {
        SCOPED_TRACE(name);
        const at::Tensor diff = (bf16.params.at(name) - p).abs();
        EXPECT_LE(diff.max().item<double>(), 6e-3 * 1.01);
        EXPECT_LE(diff.mean().item<double>(), 1e-3);
      }
    }
  });
}
