// The dispatch kernel's guarantees: no silent local run, clear errors, a bounded cache, and
// autograd through DTensor ops equal to one device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/comm/recording_backend.h"
#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

TEST(Kernel, OpWithoutRuleFailsNamingOpAndPlacements) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto dt = distribute_tensor(at::randn({4, 4}), mesh, {Shard(0)});
    EXPECT_ERROR(at::logcumsumexp(dt, 1), c10::Error,
                 "does not have a sharding strategy registered", "aten::logcumsumexp", "(S(0))");
  });
}

TEST(Kernel, DTensorsOnDifferentMeshesCannotMeet) {
  run_ranks(2, [](int) {
    auto a = init_device_mesh("cpu", {2});
    auto b = init_device_mesh("cpu", {2}, {"other"});
    auto x = distribute_tensor(at::ones({4}), a, {Replicate()});
    auto y = distribute_tensor(at::ones({4}), b, {Replicate()});
    EXPECT_ERROR(at::add(x, y), c10::Error, "different meshes");
  });
}

TEST(Kernel, InPlaceOpThatWouldChangePlacementsIsRejected) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto p = from_local(at::ones({4}), mesh, {Partial()});
    EXPECT_ERROR(p.exp_(), c10::Error, "in-place", "P(sum)");
    // Linear in-place ops keep Partial and stay correct.
    p.mul_(3.0);
    EXPECT_TENSOR_EQ(full_tensor(p), at::full({4}, 6.0));
  });
}

TEST(Kernel, PartialPlusReplicateDividesTheReplicaAndReplicatePlusPartialReduces) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto p = from_local(at::ones({3}), mesh, {Partial()});  // value 4
    auto r = from_local(at::ones({3}), mesh, {Replicate()});
    CommDebugMode comm;
    auto pr = p + r;
    EXPECT_EQ(placements(pr)[0], Partial());
    EXPECT_EQ(comm.get_total_counts(), 0);
    EXPECT_TENSOR_EQ(full_tensor(pr), at::full({3}, 5.0));
    comm.enter();
    auto rp = r + p;
    EXPECT_EQ(placements(rp)[0], Replicate());
    EXPECT_EQ(comm.get_comm_counts(), (CommCounts{{CommType::all_reduce, 1}}));
    EXPECT_TENSOR_EQ(local_tensor(rp), at::full({3}, 5.0));
  });
}

TEST(Kernel, CacheDoesNotGrowWithChangingScalars) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = distribute_tensor(at::ones({8, 4}), mesh, {Shard(0)});
    dispatch::clear_cache();
    for (int step = 1; step <= 50; ++step) {
      x.mul_(1.0 + 1.0 / step).add_(x, 0.001 * step);  // like an optimizer's changing scalars
    }
    auto stats = dispatch::cache_stats();
    EXPECT_EQ(stats.entries, 2);
    EXPECT_GE(stats.hits, 98);
  });
}

TEST(Kernel, AutogradThroughPointwiseAndReductionsMatchesOneDevice) {
  run_ranks(3, [](int) {
    auto mesh = init_device_mesh("cpu", {3});
    auto a = at::randn({7, 5}, at::kDouble);
    auto b = at::randn({5}, at::kDouble);
    auto ra = a.clone().requires_grad_(true), rb = b.clone().requires_grad_(true);
    auto ref = ((ra.exp() * rb - ra.sigmoid()).pow(2).mean(1) + ra.sum(1) * 0.5).sum();
    ref.backward();
    auto da = distribute_tensor(a.clone().requires_grad_(true), mesh, {Shard(0)});
    auto db = distribute_tensor(b.clone().requires_grad_(true), mesh, {Replicate()});
    auto out = ((da.exp() * db - da.sigmoid()).pow(2).mean(1) + da.sum(1) * 0.5).sum();
    EXPECT_EQ(placements(out)[0], Partial());
    EXPECT_TENSOR_CLOSE(full_tensor(out), ref, 1e-12, 1e-12);
    out.backward();
    EXPECT_TENSOR_CLOSE(full_tensor(da.grad()), ra.grad(), 1e-12, 1e-12);
    EXPECT_TENSOR_CLOSE(full_tensor(db.grad()), rb.grad(), 1e-12, 1e-12);
    EXPECT_DOUBLE_EQ(out.item<double>(), ref.item<double>());
  });
}

TEST(Kernel, ViewsAndReshapesKeepShardsWhenTheyCan) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto g = at::randn({4, 6, 8});
    auto x = distribute_tensor(g, mesh, {Shard(0)});
    CommDebugMode comm;
    auto v = x.view({4, 48});
    EXPECT_EQ(placements(v)[0], Shard(0));
    auto w = x.view({8, 3, 8});  // split dim 0 into (8 = 4*2) -> carried to dim 0
    EXPECT_EQ(placements(w)[0], Shard(0));
    auto t = x.transpose(0, 2);
    EXPECT_EQ(placements(t)[0], Shard(2));
    auto u = x.unsqueeze(0).squeeze(0);
    EXPECT_EQ(placements(u)[0], Shard(0));
    EXPECT_EQ(comm.get_total_counts(), 0);
    EXPECT_TENSOR_EQ(full_tensor(v), g.view({4, 48}));
    EXPECT_TENSOR_EQ(full_tensor(w), g.view({8, 3, 8}));
    EXPECT_TENSOR_EQ(full_tensor(t), g.transpose(0, 2));
    auto y = distribute_tensor(g, mesh, {Shard(1)});
    auto flat = y.reshape({24, 8});  // dim 1 is not the leftmost of (4,6): replicate first
    EXPECT_EQ(placements(flat)[0], Replicate());
    EXPECT_TENSOR_EQ(full_tensor(flat), g.reshape({24, 8}));
    auto e = distribute_tensor(at::randn({1, 6}), mesh, {Shard(1)}).expand({5, 6});
    EXPECT_EQ(placements(e)[0], Shard(1));
  });
}

// dtensor_plan's DTensors hold meta shards, and a copy that names the meta device (type_as,
// to(other.options()), the bfloat16 rounding at the end of at::rms_norm) used to bypass the
// DTensor and return a plain tensor of the global size.
TEST(Kernel, CopyNamingTheMetaDeviceKeepsAMetaDTensorADTensor) {
  comm::init_simulated_process_group({2, 0});
  {
    auto mesh = init_device_mesh("meta", {2});
    const auto on_meta = at::TensorOptions().device(at::kMeta);
    auto x = from_local(at::empty({2, 6}, on_meta.dtype(at::kFloat)), mesh, {Shard(0)});
    auto like = from_local(at::empty({2, 6}, on_meta.dtype(at::kBFloat16)), mesh, {Shard(0)});
    for (const auto& y :
         {x.type_as(like), x.to(like.options()), at::rms_norm(like, {6}, std::nullopt, 1e-6)}) {
      ASSERT_TRUE(is_dtensor(y));
      EXPECT_EQ(placements(y)[0], Shard(0));
      EXPECT_EQ(y.sizes(), (at::IntArrayRef{4, 6}));
      EXPECT_EQ(local_tensor(y).sizes(), (at::IntArrayRef{2, 6}));
      EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    }
    // Plain meta tensors still take LibTorch's kernel.
    auto plain = at::empty({3}, on_meta).to(on_meta.dtype(at::kBFloat16));
    EXPECT_FALSE(is_dtensor(plain));
    EXPECT_EQ(plain.scalar_type(), at::kBFloat16);
  }
  comm::destroy_process_group();
}

// A cached sharding decision carries the mesh of its output. A mesh of a destroyed world may
// equal one of the next by shape, ranks and names (the "tp" sub-mesh of [pp, dp, tp] and of
// [pp, tp]) while its group is another (mesh dim 2, not 1): the new world's op must not get it.
TEST(Kernel, ADecisionCachedInAnEarlierWorldDoesNotHandItsGroupsToTheNext) {
  auto add_then_gather = [](const std::vector<int64_t>& shape,
                            const std::vector<std::string>& names) {
    comm::init_simulated_process_group({8, 0});
    comm::clear_recorded_ops();
    auto tp = init_device_mesh("cpu", shape, names)["tp"];
    auto y = from_local(at::ones({2, 3}), tp, {Shard(0)}) + 1;
    (void)full_tensor(y);
    const auto ops = comm::recorded_ops();
    comm::destroy_process_group();
    return ops;
  };
  const auto first = add_then_gather({2, 2, 2}, {"pp", "dp", "tp"});
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(first.back().mesh_dim, 2);
  const auto next = add_then_gather({4, 2}, {"pp", "tp"});
  ASSERT_FALSE(next.empty());
  EXPECT_EQ(next.back().op, "all_gather_into_tensor");
  EXPECT_EQ(next.back().mesh_dim, 1) << "gathered on " << next.back().group;
  comm::clear_recorded_ops();
}

// A rule registered under a misspelt name would never be reached: every name must resolve to
// an operator the dispatcher knows.
TEST(Kernel, EveryRegisteredRuleNamesARealOperator) {
  const auto names = dispatch::registered_rule_names();
  EXPECT_GT(names.size(), 100u);
  for (const auto& name : names) {
    const auto ns = name.find("::");
    const auto dot = name.find('.', ns == std::string::npos ? 0 : ns + 2);
    const std::string op = name.substr(0, dot);
    const std::string overload = dot == std::string::npos ? "" : name.substr(dot + 1);
    EXPECT_TRUE(c10::Dispatcher::singleton().findSchema({op, overload}).has_value())
        << "a sharding rule is registered for '" << name << "', which is no operator";
  }
}

// A CompositeImplicitAutograd op whose LibTorch decomposition reads a DTensor's memory (which a
// DTensor does not have) fails naming itself and its DTensor inputs, and the next op runs;
// tensor_split by a tensor of indices or sections has a decomposition of its own and matches one
// device, forward and backward.
TEST(Kernel, CompositeOpsReadingADTensorsMemoryNameThemselvesAndTensorSplitRuns) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::manual_seed(5);
    const auto g = at::randn({2, 4, 8});
    auto x = distribute_tensor(g, mesh, {Shard(0)});
    EXPECT_ERROR(at::max_pool1d(x, {2}), c10::Error, "aten::max_pool1d",
                 "cannot run on DTensor inputs (S(0))[2, 4, 8]", "reads a DTensor's memory");
    auto rep = [&](const at::Tensor& t) { return distribute_tensor(t, mesh, {Replicate()}); };
    const auto log_probs = at::randn({6, 2, 5}).log_softmax(2);
    const auto targets = at::randint(1, 5, {2, 3});
    EXPECT_ERROR(at::ctc_loss(rep(log_probs), rep(targets), rep(at::full({2}, 6, at::kLong)),
                              rep(at::full({2}, 3, at::kLong))),
                 c10::Error, "aten::ctc_loss", "(R)[6, 2, 5], (R)[2, 3], (R)[2], (R)[2]");
    EXPECT_TENSOR_EQ(full_tensor(x * 2), g * 2);

    auto y = distribute_tensor(g, mesh, {Shard(0)}).requires_grad_(true);
    const auto leaf = g.clone().requires_grad_(true);
    for (const auto& by :
         {at::tensor(std::vector<int64_t>{1, 5}), at::scalar_tensor(3, at::kLong)}) {
      SCOPED_TRACE(by.dim() == 0 ? "sections" : "indices");
      const auto parts = at::tensor_split(y, rep(by), 2);
      const auto want = at::tensor_split(leaf, by, 2);
      ASSERT_EQ(parts.size(), want.size());
      at::Tensor loss = at::zeros({}), want_loss = at::zeros({});
      for (size_t i = 0; i < parts.size(); ++i) {
        EXPECT_EQ(placements(parts[i]), Placements{Shard(0)});
        EXPECT_TENSOR_EQ(full_tensor(parts[i]), want[i]);
        loss = loss + full_tensor(parts[i]).pow(2).sum() * static_cast<double>(i + 1);
        want_loss = want_loss + want[i].pow(2).sum() * static_cast<double>(i + 1);
      }
      y.mutable_grad() = at::Tensor();
      leaf.mutable_grad() = at::Tensor();
      loss.backward();
      want_loss.backward();
      EXPECT_TENSOR_CLOSE(full_tensor(y.grad()), leaf.grad(), 1e-6, 1e-6);
    }
  });
}

// The kinds of op that ended every rank on Gloo (conversions to complex and int16 dtypes,
// view_as_complex, FFTs of a last-dim-sharded input): each matches one device or, for the FFTs,
// which have no sharding rule, is refused before any collective; either way the next op runs.
TEST(Kernel, ComplexAndInt16ResultsOfShardedInputsMatchOneDeviceOrAreRefusedCleanly) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::manual_seed(9);
    const auto g = at::randn({4, 6, 2});
    using F = std::function<at::Tensor(const at::Tensor&)>;
    const std::vector<std::pair<const char*, F>> ops = {
        {"to(complex64)", [](const at::Tensor& t) { return t.to(at::kComplexFloat); }},
        {"to(complex128)", [](const at::Tensor& t) { return t.to(at::kComplexDouble); }},
        {"chalf", [](const at::Tensor& t) { return t.to(at::kComplexHalf); }},
        {"to(int16)", [](const at::Tensor& t) { return (t * 100).to(at::kShort); }},
        {"view_as_complex", [](const at::Tensor& t) { return at::view_as_complex(t); }},
    };
    // No sharding rule yet: refused before any collective, or, once a rule comes, equal.
    const std::vector<std::pair<const char*, F>> ruleless = {
        {"aten::_fft_c2c",
         [](const at::Tensor& t) { return at::fft_fft(t.to(at::kComplexFloat)); }},
        {"aten::_fft_r2c", [](const at::Tensor& t) { return at::fft_rfft(t); }},
    };
    for (int64_t d : {0, 1, 2}) {
      auto x = distribute_tensor(g, mesh, {Shard(d)});
      for (const auto& [name, f] : ops) {
        SCOPED_TRACE(std::string(name) + " of S(" + std::to_string(d) + ")");
        const auto got = full_tensor(f(x));
        const auto want = f(g);
        EXPECT_EQ(got.scalar_type(), want.scalar_type());
        EXPECT_TENSOR_EQ(got, want);
        EXPECT_TENSOR_EQ(full_tensor(x * 2), g * 2);
      }
      for (const auto& [name, f] : ruleless) {
        SCOPED_TRACE(std::string(name) + " of S(" + std::to_string(d) + ")");
        CommDebugMode comm;
        at::Tensor got;
        try {
          got = f(x);
        } catch (const c10::Error& e) {
          EXPECT_CONTAINS(e.what_without_backtrace(), name);
          EXPECT_CONTAINS(e.what_without_backtrace(),
                          "does not have a sharding strategy registered");
          EXPECT_EQ(comm.get_total_counts(), 0);
        }
        if (got.defined()) {
          EXPECT_TENSOR_CLOSE(full_tensor(got), f(g), 1e-5, 1e-5);
        }
        EXPECT_TENSOR_EQ(full_tensor(x * 2), g * 2);
      }
    }
  });
}
