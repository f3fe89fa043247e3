// The parallel styles on single modules (the cases of PyTorch's test_tp_style.py): parameter
// layouts, input/output conversion, exact collective counts forward and backward, values against
// one device; construction and call-time errors; which styles a plain torch::nn module accepts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "dtensor/dtensor.h"
#include "support/comm_counts.h"
#include "support/distributed.h"
#include "support/errors.h"

using namespace dtensor;
using namespace dtensor::testing;
using dtensor::tp::Kwargs;
using dtensor::tp::ModuleCall;

namespace {

constexpr double kTol = 1e-10;

constexpr CommType kAllReduce = CommType::all_reduce;
constexpr CommType kAllGather = CommType::all_gather_into_tensor;
constexpr CommType kReduceScatter = CommType::reduce_scatter_tensor;

// A hook-capable identity.
struct IdentityImpl : dtensor::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    return call_forward([](const at::Tensor& t) { return t; }, x);
  }
};
TORCH_MODULE(Identity);

// forward(x, y) = linear(x); y is recorded to check it passes through untouched.
struct TwoInputImpl : dtensor::nn::Module {
  TwoInputImpl() { linear = register_module("linear", dtensor::nn::Linear(16, 8)); }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    return call_forward(
        [this](const at::Tensor& a, const at::Tensor& b) {
          seen_y = b;
          return linear(a);
        },
        x, y);
  }
  dtensor::nn::Linear linear{nullptr};
  at::Tensor seen_y;
};
TORCH_MODULE(TwoInput);

// forward(x, *, y, z=2) = linear(x) + y + z.
struct KwargModuleImpl : dtensor::nn::Module {
  KwargModuleImpl() { linear = register_module("linear", dtensor::nn::Linear(8, 8)); }
  at::Tensor forward(const at::Tensor& x, Kwargs kwargs) {
    return call_forward_kw(
               [this](const ModuleCall& c) {
                 const c10::IValue* z = c.kwarg("z");
                 return c10::IValue(linear(c.args[0].toTensor()) + c.kwarg("y")->toTensor() +
                                    (z ? z->toTensor() : at::scalar_tensor(2.0, at::kDouble)));
               },
               ModuleCall{{x}, std::move(kwargs)})
        .toTensor();
  }
  dtensor::nn::Linear linear{nullptr};
};
TORCH_MODULE(KwargModule);

// forward(*, x, y=2, z=None) = x + y + z.
struct KeywordOnlyImpl : dtensor::nn::Module {
  at::Tensor forward(Kwargs kwargs) {
    return call_forward_kw(
               [](const ModuleCall& c) {
                 const c10::IValue* y = c.kwarg("y");
                 return c10::IValue(c.kwarg("x")->toTensor() + (y ? y->toDouble() : 2.0) +
                                    c.kwarg("z")->toTensor());
               },
               ModuleCall{{}, std::move(kwargs)})
        .toTensor();
  }
};
TORCH_MODULE(KeywordOnly);

// Returns its input and its double (two outputs).
struct PairOutImpl : dtensor::nn::Module {
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    return call_forward([](const at::Tensor& t) { return std::make_tuple(t, t * 2); }, x);
  }
};
TORCH_MODULE(PairOut);

// Two copies of a layer from the same seed: the reference and the one to parallelize.
template <class M, class... Args>
std::pair<M, M> twin(Args... args) {
  at::manual_seed(5);
  M ref(args...);
  at::manual_seed(5);
  M dist(args...);
  ref->to(at::kDouble);
  dist->to(at::kDouble);
  return {ref, dist};
}

at::Tensor chunk_of(const at::Tensor& t, int64_t dim, int64_t rank, int64_t world) {
  return t.chunk(world, dim)[rank];
}

}  // namespace

// Colwise Linear (replicated and Shard(0) inputs) and Embedding.
TEST(Styles, ColwiseLinearAndEmbeddingMatchOneDeviceWithPyTorchCommCounts) {
  run_ranks(4, [](int rank) {
    const int64_t world = 4;
    auto mesh = init_device_mesh("cpu", {world});
    {
      SCOPED_TRACE("Colwise Linear, replicated input");
      auto [ref, fc] = twin<dtensor::nn::Linear>(16, 16);
      tp::parallelize_module(*fc, mesh, tp::ColwiseParallel());
      EXPECT_EQ(placements(fc->weight)[0], Shard(0));
      EXPECT_EQ(placements(fc->bias)[0], Shard(0));
      EXPECT_TRUE(fc->weight.requires_grad());
      EXPECT_TRUE(at::equal(full_tensor(fc->weight.detach()), ref->weight.detach()));
      auto x = at::rand({8, 16}, at::kDouble);
      auto xr = x.clone().requires_grad_(true);
      auto xd = x.clone().requires_grad_(true);
      auto yr = ref(xr);
      CommDebugMode comm;
      auto yd = fc(xd);
      EXPECT_EQ(comm.get_comm_counts(), CommCounts{}) << comm.table();
      EXPECT_FALSE(is_dtensor(yd));
      EXPECT_EQ(yd.sizes(), (std::vector<int64_t>{8, 4}));
      EXPECT_TENSOR_CLOSE(yd, chunk_of(yr, 1, rank, world), kTol, kTol);
      yr.sum().backward();
      yd.sum().backward();
      EXPECT_EQ(comm.get_comm_counts(), counts({{kAllReduce, 1}})) << comm.table();
      EXPECT_TENSOR_CLOSE(xd.grad(), xr.grad(), kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(fc->weight.grad()), ref->weight.grad(), kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(fc->bias.grad()), ref->bias.grad(), kTol, kTol);
    }
    {
      SCOPED_TRACE("Colwise Linear, input_layouts=Shard(0)");
      auto [ref, fc] = twin<dtensor::nn::Linear>(16, 16);
      tp::parallelize_module(*fc, mesh, tp::ColwiseParallel({.input_layouts = Shard(0)}));
      auto x = at::rand({32, 16}, at::kDouble);  // the global input; each rank feeds its rows
      auto xr = x.clone().requires_grad_(true);
      auto xd = chunk_of(x, 0, rank, world).clone().requires_grad_(true);
      auto yr = ref(xr);
      CommDebugMode comm;
      auto yd = fc(xd);
      EXPECT_EQ(comm.get_comm_counts(), counts({{kAllGather, 1}})) << comm.table();
      EXPECT_EQ(yd.sizes(), (std::vector<int64_t>{32, 4}));
      EXPECT_TENSOR_CLOSE(yd, chunk_of(yr, 1, rank, world), kTol, kTol);
      yr.sum().backward();
      yd.sum().backward();
      EXPECT_EQ(comm.get_comm_counts(), counts({{kAllGather, 1}, {kReduceScatter, 1}}))
          << comm.table();
      EXPECT_TENSOR_CLOSE(xd.grad(), chunk_of(xr.grad(), 0, rank, world), kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(fc->weight.grad()), ref->weight.grad(), kTol, kTol);
    }
    {
      SCOPED_TRACE("Colwise Embedding");
      auto [ref, emb] = twin<dtensor::nn::Embedding>(16, 16);
      tp::parallelize_module(*emb, mesh, tp::ColwiseParallel());
      EXPECT_EQ(placements(emb->weight)[0], Shard(1));
      auto idx = at::arange(8, at::kLong).reshape({4, 2});
      auto yr = ref(idx);
      CommDebugMode comm;
      auto yd = emb(idx);
      EXPECT_EQ(yd.sizes(), (std::vector<int64_t>{4, 2, 4}));
      EXPECT_TENSOR_CLOSE(yd, chunk_of(yr, 2, rank, world), kTol, kTol);
      yd.sum().backward();
      EXPECT_EQ(comm.get_comm_counts(), CommCounts{}) << comm.table();
      yr.sum().backward();
      EXPECT_TENSOR_CLOSE(full_tensor(emb->weight.grad()), ref->weight.grad(), kTol, kTol);
    }
  });
}

// Rowwise Linear (Replicate and Shard(0) outputs) and Embedding.
TEST(Styles, RowwiseLinearAndEmbeddingMatchOneDeviceWithPyTorchCommCounts) {
  run_ranks(4, [](int rank) {
    const int64_t world = 4;
    auto mesh = init_device_mesh("cpu", {world});
    for (bool shard_output : {false, true}) {
      SCOPED_TRACE(shard_output ? "Rowwise Linear, output_layouts=Shard(0)" : "Rowwise Linear");
      auto [ref, fc] = twin<dtensor::nn::Linear>(16, 16);
      tp::RowwiseParallelOptions o;
      if (shard_output) o.output_layouts = Shard(0);
      tp::parallelize_module(*fc, mesh, tp::RowwiseParallel(o));
      EXPECT_EQ(placements(fc->weight)[0], Shard(1));
      EXPECT_EQ(placements(fc->bias)[0], Replicate());
      auto x = at::rand({8, 16}, at::kDouble);
      auto xr = x.clone().requires_grad_(true);
      auto xd = chunk_of(x, 1, rank, world).clone().requires_grad_(true);  // (8, 4)
      auto yr = ref(xr);
      CommDebugMode comm;
      auto yd = fc(xd);
      EXPECT_EQ(comm.get_comm_counts(), counts({{shard_output ? kReduceScatter : kAllReduce, 1}}))
          << comm.table();
      EXPECT_FALSE(is_dtensor(yd));
      EXPECT_TENSOR_CLOSE(yd, shard_output ? chunk_of(yr, 0, rank, world) : yr, kTol, kTol);
      comm.enter();
      yd.sum().backward();
      EXPECT_EQ(comm.get_comm_counts(), shard_output ? counts({{kAllGather, 1}}) : CommCounts{})
          << comm.table();
      yr.sum().backward();
      EXPECT_TENSOR_CLOSE(xd.grad(), chunk_of(xr.grad(), 1, rank, world), kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(fc->weight.grad()), ref->weight.grad(), kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(fc->bias.grad()), ref->bias.grad(), kTol, kTol);
    }
    for (bool shard_output : {false, true}) {
      SCOPED_TRACE(shard_output ? "Rowwise Embedding, output_layouts=Shard(1)"
                                : "Rowwise Embedding, input_layouts=Replicate()");
      auto [ref, emb] = twin<dtensor::nn::Embedding>(16, 16);
      tp::RowwiseParallelOptions o{.input_layouts = Replicate()};
      if (shard_output) o.output_layouts = Shard(1);
      tp::parallelize_module(*emb, mesh, tp::RowwiseParallel(o));
      EXPECT_EQ(placements(emb->weight)[0], Shard(0));
      auto idx = shard_output ? at::arange(8, at::kLong) : at::randint(16, {4, 2}, at::kLong);
      auto yr = ref(idx);
      CommDebugMode comm;
      auto yd = emb(idx);
      EXPECT_EQ(comm.get_comm_counts(), counts({{shard_output ? kReduceScatter : kAllReduce, 1}}))
          << comm.table();
      EXPECT_EQ(yd.sizes(),
                (shard_output ? std::vector<int64_t>{8, 4} : std::vector<int64_t>{4, 2, 16}));
      EXPECT_TENSOR_CLOSE(yd, shard_output ? chunk_of(yr, 1, rank, world) : yr, kTol, kTol);
      comm.enter();
      yd.sum().backward();
      EXPECT_EQ(comm.get_comm_counts(), shard_output ? counts({{kAllGather, 1}}) : CommCounts{})
          << comm.table();
      yr.sum().backward();
      EXPECT_TENSOR_CLOSE(full_tensor(emb->weight.grad()), ref->weight.grad(), kTol, kTol);
    }
  });
}

// PrepareModuleInput (positional and keyword), PrepareModuleOutput and PrepareModuleInputOutput.
TEST(Styles, PrepareModuleInputOutputConvertPositionalAndKeywordInputs) {
  run_ranks(4, [](int rank) {
    const int64_t world = 4;
    auto mesh = init_device_mesh("cpu", {world});
    {
      SCOPED_TRACE("PrepareModuleInput on Identity, Shard(0) -> Replicate");
      Identity id;
      tp::parallelize_module(
          *id, mesh,
          tp::PrepareModuleInput({.input_layouts = tp::Layouts{Shard(0)},
                                  .desired_input_layouts = tp::Layouts{Replicate()}}));
      auto x = at::rand({8, 16}, at::kDouble);
      CommDebugMode comm;
      auto y = id(chunk_of(x, 0, rank, world));
      EXPECT_EQ(comm.get_comm_counts(), counts({{kAllGather, 1}})) << comm.table();
      ASSERT_TRUE(is_dtensor(y));
      EXPECT_EQ(placements(y)[0], Replicate());
      EXPECT_TENSOR_EQ(full_tensor(y), x);
    }
    {
      SCOPED_TRACE("PrepareModuleInput (Shard(0), None) on a two-input module, Colwise inside");
      at::manual_seed(5);
      TwoInput m;
      m->to(at::kDouble);
      torch::nn::Linear ref(16, 8);
      ref->to(at::kDouble);
      {
        at::NoGradGuard g;
        ref->weight.copy_(m->linear->weight);
        ref->bias.copy_(m->linear->bias);
      }
      tp::parallelize_module(
          *m, mesh,
          tp::ParallelizePlan{
              {"", tp::PrepareModuleInput(
                       {.input_layouts = tp::Layouts{Shard(0), std::nullopt},
                        .desired_input_layouts = tp::Layouts{Replicate(), std::nullopt}})},
              {"linear", tp::ColwiseParallel()}});
      auto x = at::rand({8, 16}, at::kDouble);
      auto y = at::rand({3}, at::kDouble);
      auto out = m(chunk_of(x, 0, rank, world), y);
      EXPECT_EQ(out.sizes(), (std::vector<int64_t>{8, 2}));
      EXPECT_TENSOR_CLOSE(out, chunk_of(ref(x), 1, rank, world), kTol, kTol);
      EXPECT_FALSE(is_dtensor(m->seen_y));
      EXPECT_TRUE(m->seen_y.is_same(y));
    }
    {
      SCOPED_TRACE("PrepareModuleInput kwargs {y: Shard(0) -> Replicate}");
      at::manual_seed(5);
      KwargModule m;
      m->to(at::kDouble);
      auto w = m->linear->weight.detach().clone();
      auto b = m->linear->bias.detach().clone();
      tp::parallelize_module(
          *m, mesh,
          tp::ParallelizePlan{
              {"", tp::PrepareModuleInput(
                       {.input_kwarg_layouts = tp::KwargLayouts{{"y", Shard(0)}},
                        .desired_input_kwarg_layouts = tp::KwargLayouts{{"y", Replicate()}}})},
              {"linear", tp::ColwiseParallel({.use_local_output = false})}});
      auto x = at::randn({4, 8}, at::kDouble);
      auto y = at::randn({4, 8}, at::kDouble);
      CommDebugMode comm;
      auto out = m->forward(x, {{"y", chunk_of(y, 0, rank, world)}});
      EXPECT_EQ(comm.get_total_counts(), 1) << comm.table();
      EXPECT_EQ(out.sizes(), (std::vector<int64_t>{4, 8}));
      EXPECT_TENSOR_CLOSE(full_tensor(out), at::linear(x, w, b) + y + 2, kTol, kTol);
    }
    for (bool dtensor_x : {false, true}) {
      SCOPED_TRACE(dtensor_x ? "keyword-only module, x already a Shard(0) DTensor"
                             : "keyword-only module {x, z: Shard(0) -> Replicate}");
      KeywordOnly m;
      tp::parallelize_module(
          *m, mesh,
          tp::PrepareModuleInput(
              {.input_kwarg_layouts = tp::KwargLayouts{{"x", Shard(0)}, {"z", Shard(0)}},
               .desired_input_kwarg_layouts =
                   tp::KwargLayouts{{"x", Replicate()}, {"z", Replicate()}}}));
      auto x = at::randn({4, 8}, at::kDouble);
      auto z = at::randn({4, 8}, at::kDouble);
      at::Tensor xin = dtensor_x ? distribute_tensor(x, mesh, {Shard(0)}, std::nullopt)
                                 : chunk_of(x, 0, rank, world);
      CommDebugMode comm;
      auto out = m->forward({{"x", xin}, {"z", chunk_of(z, 0, rank, world)}});
      EXPECT_EQ(comm.get_total_counts(), 2) << comm.table();
      EXPECT_EQ(out.sizes(), (std::vector<int64_t>{4, 8}));
      EXPECT_TENSOR_CLOSE(full_tensor(out), x + 2 + z, kTol, kTol);
    }
    {
      SCOPED_TRACE("PrepareModuleOutput on Identity, Replicate -> Shard(0)");
      Identity id;
      tp::parallelize_module(*id, mesh,
                             tp::PrepareModuleOutput({.output_layouts = {Replicate()},
                                                      .desired_output_layouts = {Shard(0)}}));
      auto x = at::rand({8, 16}, at::kDouble);
      CommDebugMode comm;
      auto y = id(x);
      EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
      EXPECT_FALSE(is_dtensor(y));
      EXPECT_TENSOR_EQ(y, chunk_of(x, 0, rank, world));
    }
    {
      SCOPED_TRACE("PrepareModuleOutput with two outputs, the second left alone");
      PairOut m;
      tp::parallelize_module(
          *m, mesh,
          tp::PrepareModuleOutput({.output_layouts = {Replicate(), std::nullopt},
                                   .desired_output_layouts = {Shard(1), std::nullopt}}));
      auto x = at::rand({4, 8}, at::kDouble);
      auto [a, b] = m(x);
      EXPECT_TENSOR_EQ(a, chunk_of(x, 1, rank, world));
      EXPECT_FALSE(is_dtensor(b));
      EXPECT_TENSOR_EQ(b, x * 2);
    }
    {
      SCOPED_TRACE("Case 15: PrepareModuleInputOutput, input Shard(0) -> R, output R -> Shard(1)");
      Identity id;
      tp::parallelize_module(
          *id, mesh,
          tp::PrepareModuleInputOutput({.input_layouts = tp::Layouts{Shard(0)},
                                        .desired_input_layouts = tp::Layouts{Replicate()},
                                        .output_layouts = {Replicate()},
                                        .desired_output_layouts = {Shard(1)}}));
      auto all = at::rand({20, 7}, at::kDouble);  // the four ranks' (5, 7) inputs, stacked
      CommDebugMode comm;
      auto y = id(chunk_of(all, 0, rank, world));
      EXPECT_EQ(comm.get_comm_counts(), counts({{kAllGather, 1}})) << comm.table();
      EXPECT_FALSE(is_dtensor(y));
      EXPECT_TENSOR_EQ(y, chunk_of(all, 1, rank, world));
    }
  });
}

// SequenceParallel on norms and dropout.
TEST(Styles, SequenceParallelKeepsSequenceShardsWithoutCommunication) {
  run_ranks(4, [](int rank) {
    const int64_t world = 4;
    auto mesh = init_device_mesh("cpu", {world});
    using Fwd = std::function<at::Tensor(const at::Tensor&)>;
    struct Case {
      std::string name;
      std::shared_ptr<torch::nn::Module> ref, dist;
      Fwd ref_fwd, dist_fwd;
      bool compare_values = true;
    };
    std::vector<Case> cases;
    for (bool affine : {true, false}) {
      auto [r, d] = twin<dtensor::nn::LayerNorm>(
          torch::nn::LayerNormOptions({12}).elementwise_affine(affine));
      cases.push_back({affine ? "LayerNorm" : "LayerNorm without affine", r.ptr(), d.ptr(),
                       [r](const at::Tensor& x) mutable { return r(x); },
                       [d](const at::Tensor& x) mutable { return d(x); }});
    }
    {
      auto [r, d] = twin<dtensor::nn::RMSNorm>(12);
      cases.push_back({"RMSNorm", r.ptr(), d.ptr(),
                       [r](const at::Tensor& x) mutable { return r(x); },
                       [d](const at::Tensor& x) mutable { return d(x); }});
    }
    {
      auto [r, d] = twin<dtensor::nn::Dropout>(0.5);
      cases.push_back({"Dropout", r.ptr(), d.ptr(),
                       [r](const at::Tensor& x) mutable { return r(x); },
                       [d](const at::Tensor& x) mutable { return d(x); }, false});
    }
    for (auto& c : cases) {
      SCOPED_TRACE(c.name);
      tp::parallelize_module(*c.dist, mesh, tp::SequenceParallel());
      // Non-trivial values, set identically on every rank (SequenceParallel does not broadcast).
      {
        at::NoGradGuard g;
        for (const auto& p : c.ref->named_parameters()) {
          p.value().copy_(at::rand(p.value().sizes(), at::kDouble));
          local_tensor(c.dist->named_parameters()[p.key()]).copy_(p.value());
        }
      }
      for (const auto& p : c.dist->parameters()) {
        EXPECT_EQ(placements(p)[0], Replicate());
        EXPECT_TRUE(p.requires_grad());
      }
      auto x = at::rand({20, 32, 12}, at::kDouble);
      auto xr = x.clone().requires_grad_(true);
      auto xd = distribute_tensor(x, mesh, {Shard(1)}).requires_grad_(true);
      CommDebugMode comm;
      auto yd = c.dist_fwd(xd);
      ASSERT_TRUE(is_dtensor(yd));
      EXPECT_EQ(placements(yd)[0], Shard(1));
      yd.sum().backward();
      EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
      comm.exit();
      if (!c.compare_values) continue;
      auto yr = c.ref_fwd(xr);
      yr.sum().backward();
      EXPECT_TENSOR_CLOSE(full_tensor(yd), yr, kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(xd.grad()), xr.grad(), kTol, kTol);
      for (const auto& p : c.ref->named_parameters()) {
        const at::Tensor g = c.dist->named_parameters()[p.key()].grad();
        EXPECT_TRUE(placements(g)[0].is_partial()) << p.key();
        EXPECT_TENSOR_CLOSE(full_tensor(g), p.value().grad(), kTol, kTol);
      }
    }
    {
      SCOPED_TRACE("RMSNorm with a Shard(0) input: moved to Shard(1)");
      auto [ref, norm] = twin<dtensor::nn::RMSNorm>(12);
      tp::parallelize_module(*norm, mesh, tp::SequenceParallel());
      auto x = at::rand({20, 32, 12}, at::kDouble);
      auto xr = x.clone().requires_grad_(true);
      auto xd = distribute_tensor(x, mesh, {Shard(0)}).requires_grad_(true);
      CommDebugMode comm;
      auto yd = norm(xd);
      EXPECT_EQ(placements(yd)[0], Shard(1));
      yd.sum().backward();
      EXPECT_EQ(comm.get_total_counts(), 2) << comm.table();
      EXPECT_TRUE(placements(norm->weight.grad())[0].is_partial());
      auto yr = ref(xr);
      yr.sum().backward();
      EXPECT_TENSOR_CLOSE(full_tensor(yd), yr, kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(norm->weight.grad()), ref->weight.grad(), kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(xd.grad()), xr.grad(), kTol, kTol);
    }
    {
      SCOPED_TRACE("plain input taken as the sequence shard; use_local_output");
      auto [ref, norm] = twin<dtensor::nn::LayerNorm>(torch::nn::LayerNormOptions({12}));
      tp::parallelize_module(*norm, mesh, tp::SequenceParallel({.use_local_output = true}));
      auto x = at::rand({2, 8, 12}, at::kDouble);
      auto y = norm(chunk_of(x, 1, rank, world));
      EXPECT_FALSE(is_dtensor(y));
      EXPECT_TENSOR_CLOSE(y, chunk_of(ref(x), 1, rank, world), kTol, kTol);
    }
  });
}

// Construction-time checks and call-time errors, with PyTorch's messages.
TEST(Styles, BadArgumentsAndCallsRaisePyTorchsErrors) {
  using tp::Layouts;
  EXPECT_ERROR(
      tp::PrepareModuleInput({.input_layouts = Layouts{Shard(0)},
                              .desired_input_layouts = Layouts{Replicate(), std::nullopt}}),
      c10::Error, "input_layouts and desired_input_layouts should have same length!");
  EXPECT_ERROR(tp::PrepareModuleInput({.input_layouts = Layouts{Shard(0)}}), c10::Error,
               "desired module inputs should not be None!");
  EXPECT_ERROR(tp::PrepareModuleInput({.input_kwarg_layouts = tp::KwargLayouts{{"y", Shard(0)}}}),
               c10::Error,
               "input_kwarg_layouts and desired_input_kwarg_layouts should have same length!");
  EXPECT_ERROR(tp::PrepareModuleOutput({.output_layouts = {Replicate(), Replicate()},
                                        .desired_output_layouts = {Shard(0)}}),
               c10::Error, "output_layouts and desired_output_layouts should have same length!");
  EXPECT_ERROR(tp::PrepareModuleInputOutput({.input_layouts = Layouts{Shard(0)},
                                             .desired_input_layouts = Layouts{},
                                             .output_layouts = {Replicate()},
                                             .desired_output_layouts = {Shard(0)}}),
               c10::Error, "input_layouts and desired_input_layouts should have same length!");

  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    {
      TwoInput m;
      tp::parallelize_module(
          *m, mesh,
          tp::PrepareModuleInput(
              {.input_layouts = Layouts{Shard(0)}, .desired_input_layouts = Layouts{Replicate()}}));
      EXPECT_ERROR(m(at::ones({2, 16}), at::ones({2})), c10::Error,
                   "module inputs and input_layouts should have same length!");
    }
    {
      KeywordOnly m;
      tp::parallelize_module(
          *m, mesh,
          tp::PrepareModuleInput(
              {.input_kwarg_layouts = tp::KwargLayouts{{"y", Shard(0)}},
               .desired_input_kwarg_layouts = tp::KwargLayouts{{"y", Replicate()}}}));
      EXPECT_ERROR(
          m->forward({{"x", at::ones({2})}, {"y", c10::IValue(3.0)}, {"z", at::ones({2})}}),
          c10::Error, "expecting input to be a torch.Tensor!");
    }
    {
      PairOut m;
      tp::parallelize_module(*m, mesh,
                             tp::PrepareModuleOutput({.output_layouts = {Replicate()},
                                                      .desired_output_layouts = {Shard(0)}}));
      EXPECT_ERROR(m(at::ones({2, 2})), c10::Error,
                   "module outputs and output_layouts should have same length!");
    }
    // Unsupported module types, named with their path and type.
    for (const tp::Style& style :
         {tp::Style(tp::ColwiseParallel()), tp::Style(tp::RowwiseParallel())}) {
      torch::nn::Sequential seq(dtensor::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
      EXPECT_ERROR(tp::parallelize_module(*seq, mesh, tp::ParallelizePlan{{"0", style}}),
                   c10::Error, "currently only support nn.Linear and nn.Embedding!",
                   "module '0' (dtensor::nn::LayerNorm)");
      EXPECT_FALSE(is_dtensor(seq[0]->named_parameters()["weight"]));
    }
  });
}

// A plain torch::nn module has no hooks: styles whose hooks would be no-ops for DTensor inputs
// still shard it and compute through sharding propagation; the others are refused up front.
TEST(Styles, PlainTorchModulesAcceptOnlyStylesWhoseHooksAreNoOps) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    {
      SCOPED_TRACE("plain MLP, Colwise + Rowwise without local outputs");
      at::manual_seed(5);
      torch::nn::Sequential ref(torch::nn::Linear(10, 16), torch::nn::ReLU(),
                                torch::nn::Linear(16, 10));
      at::manual_seed(5);
      torch::nn::Sequential mlp(torch::nn::Linear(10, 16), torch::nn::ReLU(),
                                torch::nn::Linear(16, 10));
      ref->to(at::kDouble);
      mlp->to(at::kDouble);
      tp::parallelize_module(
          *mlp, mesh,
          tp::ParallelizePlan{{"0", tp::ColwiseParallel({.use_local_output = false})},
                              {"2", tp::RowwiseParallel({.use_local_output = false})}});
      auto* fc1 = mlp[0]->as<torch::nn::Linear>();
      EXPECT_EQ(placements(fc1->weight)[0], Shard(0));
      auto x = at::rand({8, 10}, at::kDouble);
      auto xr = x.clone().requires_grad_(true);
      auto xd = distribute_tensor(x, mesh, {Replicate()}).requires_grad_(true);
      CommDebugMode comm;
      auto yd = mlp->forward(xd);
      EXPECT_TRUE(placements(yd)[0].is_partial());  // reduced where it is used
      auto full = full_tensor(yd);
      EXPECT_EQ(comm.get_comm_counts(), counts({{kAllReduce, 1}})) << comm.table();
      auto yr = ref->forward(xr);
      EXPECT_TENSOR_CLOSE(full, yr, kTol, kTol);
      full.sum().backward();
      yr.sum().backward();
      EXPECT_TENSOR_CLOSE(full_tensor(xd.grad()), xr.grad(), kTol, kTol);
      EXPECT_TENSOR_CLOSE(full_tensor(fc1->weight.grad()),
                          ref[0]->as<torch::nn::Linear>()->weight.grad(), kTol, kTol);
    }
    {
      SCOPED_TRACE("plain LayerNorm, SequenceParallel on a Shard(1) DTensor");
      torch::nn::LayerNorm ref(torch::nn::LayerNormOptions({6}));
      torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({6}));
      ref->to(at::kDouble);
      norm->to(at::kDouble);
      tp::parallelize_module(*norm, mesh, tp::SequenceParallel());
      auto x = at::rand({2, 8, 6}, at::kDouble);
      auto y = norm(distribute_tensor(x, mesh, {Shard(1)}));
      EXPECT_EQ(placements(y)[0], Shard(1));
      EXPECT_TENSOR_CLOSE(full_tensor(y), ref(x), kTol, kTol);
    }
    // Refused: the message names the module, its type, the style and the fix; nothing changes.
    struct Refused {
      tp::Style style;
      std::string need;
    };
    const std::vector<Refused> refused = {
        {tp::ColwiseParallel(), "returning the local shard (use_local_output=True)"},
        {tp::ColwiseParallel({.input_layouts = Shard(0), .use_local_output = false}),
         "input_layouts=(Shard(dim=0),)"},
        {tp::ColwiseParallel({.output_layouts = Replicate(), .use_local_output = false}),
         "output_layouts=(Replicate(),)"},
        {tp::RowwiseParallel(), "use_local_output=True"},
        {tp::RowwiseParallel({.output_layouts = Shard(0), .use_local_output = false}),
         "output_layouts=(Shard(dim=0),)"},
        {tp::SequenceParallel({.use_local_output = true}), "use_local_output=True"},
        {tp::PrepareModuleInput({.input_layouts = tp::Layouts{Shard(0)},
                                 .desired_input_layouts = tp::Layouts{Replicate()}}),
         "converting the module's inputs"},
        {tp::PrepareModuleOutput(
             {.output_layouts = {Replicate()}, .desired_output_layouts = {Shard(0)}}),
         "converting the module's outputs"},
    };
    for (const auto& r : refused) {
      SCOPED_TRACE(r.style.repr());
      torch::nn::Sequential seq(torch::nn::Linear(8, 8));
      const at::Tensor before = seq[0]->as<torch::nn::Linear>()->weight;
      EXPECT_ERROR(tp::parallelize_module(*seq, mesh, tp::ParallelizePlan{{"0", r.style}}),
                   c10::Error, "module '0' (torch::nn::Linear)", r.style.repr(), r.need,
                   "use dtensor::nn::Linear, a drop-in subclass of torch::nn::LinearImpl, "
                   "or derive your module from dtensor::nn::Module and route forward "
                   "through call_forward");
      EXPECT_TRUE(seq[0]->as<torch::nn::Linear>()->weight.is_same(before));
    }
    {
      torch::nn::Sequential seq(torch::nn::Linear(8, 8));
      EXPECT_ERROR(
          tp::parallelize_module(*seq, mesh, tp::ParallelizePlan{{"0", tp::ColwiseParallel()}}),
          c10::Error, "or set use_local_output=false and pass DTensor inputs");
    }
    (void)rank;
  });
}
