// Layer norm and RMS norm: sweeps against one device (forward and every gradient), the output_mask
// cases, and sequence-parallel semantics: a Shard(1) input runs with no communication forward or
// backward and leaves Partial weight gradients.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/normalization.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;

namespace {

struct NormCase {
  std::vector<int64_t> shape;
  std::vector<int64_t> normalized;
};

const std::vector<NormCase>& norm_cases() {
  static const std::vector<NormCase> c{
      {{4, 6, 8}, {8}}, {{4, 6, 8}, {6, 8}}, {{5, 3}, {3}}, {{7}, {7}}};
  return c;
}

// x * rsqrt(mean(x^2, -1) + eps) * weight, as models write it by hand.
at::Tensor handwritten_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps = 1e-6) {
  return x * at::rsqrt(x.pow(2).mean({-1}, true) + eps) * w;
}

// A module with the hand-written RMS norm (LibTorch 2.13 has no torch::nn::RMSNorm).
struct RMSNormImpl : torch::nn::Module, ParameterSwapTarget {
  explicit RMSNormImpl(int64_t dim) {
    weight = register_parameter("weight", at::ones({dim}, at::kDouble));
  }
  at::Tensor forward(const at::Tensor& x) { return handwritten_rms_norm(x, weight); }
  void on_parameter_replaced(const std::string&, const at::Tensor& value) override {
    weight = value;
  }
  at::Tensor weight;
};

}  // namespace

TEST(NormSweep, LayerNormMatchesOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      for (const auto& c : norm_cases()) {
        auto x = at::randn(c.shape, at::kDouble);
        auto w = at::randn(c.normalized, at::kDouble), b = at::randn(c.normalized, at::kDouble);
        const auto normalized = c.normalized;
        for (int affine = 0; affine < 3; ++affine) {  // none, weight, weight and bias
          OpFn fn = [normalized, affine](const std::vector<at::Tensor>& t) {
            at::Tensor wt = affine > 0 ? t[1] : at::Tensor(), bt = affine > 1 ? t[2] : at::Tensor();
            return std::vector<at::Tensor>{at::layer_norm(t[0], normalized, wt, bt, 1e-5)};
          };
          for (const auto& px : placements_1d(x.dim(), true)) {
            for (const Placements& pw : {Placements{Replicate()}, Placements{Shard(0)}}) {
              const auto label = "layer_norm " + c10::str(x.sizes()) + " over " +
                                 c10::str(c10::IntArrayRef(normalized)) + " affine " +
                                 std::to_string(affine) + " " + to_string(px) + " w" +
                                 to_string(pw);
              n.add(check_op(mesh, label, fn, {x, w, b}, {px, pw, pw}));
            }
          }
        }
      }
      // 3 affine variants x 2 weight layouts x ndim + 2 input layouts of each case (ndim 3, 3, 2,
      // 1).
      n.expect_cases(3 * 2 * (5 + 5 + 4 + 3), rank, c10::str("layer_norm, world ", world));
    });
  }
}

// Only some gradients asked for: native_layer_norm_backward gets an output_mask with holes.
TEST(NormSweep, LayerNormOutputMaskMatchesOneDevice) {
  run_ranks(3, [](int rank) {
    auto mesh = init_device_mesh("cpu", {3});
    SweepCounter n;
    auto x = at::randn({6, 5, 4}, at::kDouble);
    auto w = at::randn({4}, at::kDouble), b = at::randn({4}, at::kDouble);
    OpFn fn = [](const std::vector<at::Tensor>& t) {
      return std::vector<at::Tensor>{at::layer_norm(t[0], {4}, t[1], t[2], 1e-5)};
    };
    const std::vector<std::vector<bool>> masks{
        {true, false, false}, {false, true, true}, {false, true, false}, {true, false, true}};
    for (const auto& mask : masks) {
      for (const auto& px : placements_1d(3, false)) {
        const auto label = "layer_norm grads " + std::to_string(mask[0]) + std::to_string(mask[1]) +
                           std::to_string(mask[2]) + " " + to_string(px);
        n.add(check_op(mesh, label, fn, {x, w, b}, {px, {Replicate()}, {Replicate()}},
                       {.requires_grad = mask}));
      }
    }
    n.expect_cases(4 * 4, rank, "layer_norm output masks");
  });
}

TEST(NormSweep, RmsNormMatchesOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      for (const auto& c : norm_cases()) {
        auto x = at::randn(c.shape, at::kDouble);
        auto w = at::randn(c.normalized, at::kDouble);
        const auto normalized = c.normalized;
        const std::vector<std::pair<std::string, OpFn>> fns{
            {"at::rms_norm",
             [normalized](const std::vector<at::Tensor>& t) {
               return std::vector<at::Tensor>{at::rms_norm(t[0], normalized, t[1], 1e-6)};
             }},
            {"at::rms_norm without weight",
             [normalized](const std::vector<at::Tensor>& t) {
               return std::vector<at::Tensor>{at::rms_norm(t[0], normalized, std::nullopt, 1e-6) *
                                              t[1].sum()};
             }},
        };
        for (const auto& [name, fn] : fns) {
          for (const auto& px : placements_1d(x.dim(), true)) {
            // at::rms_norm's decomposition adds eps in place to a mean over the normalised
            // dims; with those sharded the mean is a pending average, which an in-place op
            // cannot reduce (as in PyTorch). Sequence/batch shards are what models use.
            if (px[0].is_shard() &&
                px[0].dim() >= x.dim() - static_cast<int64_t>(normalized.size()))
              continue;
            const auto label = name + " " + c10::str(x.sizes()) + " over " +
                               c10::str(c10::IntArrayRef(normalized)) + " " + to_string(px);
            n.add(check_op(mesh, label, fn, {x, w}, {px, {Replicate()}}));
          }
        }
        if (c.normalized.size() != 1) continue;
        for (const auto& px : placements_1d(x.dim(), true)) {
          OpFn fn = [](const std::vector<at::Tensor>& t) {
            return std::vector<at::Tensor>{handwritten_rms_norm(t[0], t[1])};
          };
          n.add(check_op(mesh, "hand-written rms norm " + c10::str(x.sizes()) + " " + to_string(px),
                         fn, {x, w}, {px, {Replicate()}}));
        }
      }
      // The 2 at::rms_norm functions on the layouts that leave the normalised dims whole
      // ([4, 6, 8] over [8]: 4, over [6, 8]: 3, [5, 3]: 3, [7]: 2), and the hand-written one on
      // every layout of the cases that normalise one dim (5 + 4 + 3).
      n.expect_cases(
          2 * (4 + 3 + 3 + 2) + (5 + 4 + 3), rank,
          c10::str("rms_norm (fused op decomposed on CPU, hand-written), world ", world));
    });
  }
}

TEST(NormSweep, TwoDimensionalMeshMatchesOneDevice) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    SweepCounter n;
    auto x = at::randn({4, 6, 8}, at::kDouble);
    auto w = at::randn({8}, at::kDouble), b = at::randn({8}, at::kDouble);
    const std::vector<Placement> choices{Replicate(), Shard(0), Shard(1), Shard(2), Partial()};
    for (const auto& p0 : choices) {
      for (const auto& p1 : choices) {
        Placements p{p0, p1};
        n.add(check_op(mesh, "layer_norm " + to_string(p),
                       [](const std::vector<at::Tensor>& t) {
                         return std::vector<at::Tensor>{
                             at::layer_norm(t[0], {8}, t[1], t[2], 1e-5)};
                       },
                       {x, w, b}, {p, {Replicate(), Replicate()}, {Replicate(), Replicate()}}));
        if (p0.is_shard(2) || p1.is_shard(2)) continue;  // see RmsNormMatchesOneDevice
        n.add(check_op(mesh, "rms_norm " + to_string(p),
                       [](const std::vector<at::Tensor>& t) {
                         return std::vector<at::Tensor>{at::rms_norm(t[0], {8}, t[1], 1e-6)};
                       },
                       {x, w}, {p, {Replicate(), Replicate()}}));
      }
    }
    // layer_norm on all 5 x 5 layouts, rms_norm on the 4 x 4 without S(2).
    n.expect_cases(5 * 5 + 4 * 4, rank, "norms, 2x2 mesh");
  });
}

TEST(LayerNorm, StatisticsFollowTheInputAndMaskedGradientsAreUndefined) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = at::randn({4, 6, 8}, at::kDouble);
    auto w = at::randn({8}, at::kDouble), b = at::randn({8}, at::kDouble);
    auto dx = distribute_tensor(x, mesh, {Shard(1)});
    auto dw = distribute_tensor(w, mesh, {Replicate()}),
         db = distribute_tensor(b, mesh, {Replicate()});
    auto [out, mean, rstd] = at::native_layer_norm(dx, {8}, dw, db, 1e-5);
    auto [rout, rmean, rrstd] = at::native_layer_norm(x, {8}, w, b, 1e-5);
    for (const auto& t : {out, mean, rstd}) EXPECT_EQ(placements(t)[0], Shard(1));
    EXPECT_EQ(mean.sizes(), rmean.sizes());
    EXPECT_TENSOR_CLOSE(full_tensor(mean), rmean, 1e-12, 1e-12);
    EXPECT_TENSOR_CLOSE(full_tensor(rstd), rrstd, 1e-12, 1e-12);

    auto g = at::randn({4, 6, 8}, at::kDouble);
    auto dg = distribute_tensor(g, mesh, {Shard(1)});
    auto [gi, gw, gb] =
        at::native_layer_norm_backward(dg, dx, {8}, mean, rstd, dw, db, {false, true, false});
    auto [rgi, rgw, rgb] =
        at::native_layer_norm_backward(g, x, {8}, rmean, rrstd, w, b, {false, true, false});
    EXPECT_FALSE(gi.defined());
    EXPECT_FALSE(gb.defined());
    ASSERT_TRUE(gw.defined());
    EXPECT_EQ(placements(gw)[0], Partial());
    EXPECT_TENSOR_CLOSE(full_tensor(gw), rgw, 1e-10, 1e-10);
  });
}

// SequenceParallel on norms: parameters are replicated from local copies, the input is Shard(1);
// nothing is communicated forward or backward, the output stays Shard(1) and the parameter
// gradients are Partial.
TEST(SequenceParallelNorms, ShardOneInputNeedsNoCommunication) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    auto x = at::rand({20, 8 * 4, 12}, at::kDouble);
    auto check = [&](const std::string& name, torch::nn::Module& module,
                     const std::function<at::Tensor(const at::Tensor&)>& forward) {
      SCOPED_TRACE(name);
      std::vector<std::pair<std::string, at::Tensor>> initial;
      for (const auto& item : module.named_parameters()) {
        initial.emplace_back(item.key(), item.value().detach().clone());
      }
      // One device, on plain copies of the parameters.
      for (const auto& [key, value] : initial) replace_parameter(module, key, value.clone());
      auto xr = x.clone().requires_grad_(true);
      const at::Tensor ref = forward(xr);
      ref.sum().backward();
      std::vector<at::Tensor> ref_grads;
      for (const auto& p : module.parameters()) ref_grads.push_back(p.grad());
      // Sequence parallel.
      for (const auto& [key, value] : initial) {
        replace_parameter(module, key, from_local(value.clone(), mesh, {Replicate()}));
      }
      auto dx = distribute_tensor(x, mesh, {Shard(1)}).requires_grad_(true);
      CommDebugMode comm;
      auto y = forward(dx);
      EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
      EXPECT_EQ(placements(y)[0], Shard(1));
      auto loss = y.sum();
      comm.enter();
      loss.backward();
      EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
      comm.exit();
      EXPECT_TENSOR_CLOSE(full_tensor(y.detach()), ref.detach(), 1e-10, 1e-10);
      const auto params = module.parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        ASSERT_TRUE(params[i].grad().defined());
        EXPECT_EQ(placements(params[i].grad())[0], Partial());
        EXPECT_TENSOR_CLOSE(full_tensor(params[i].grad()), ref_grads[i], 1e-10, 1e-10);
      }
      EXPECT_EQ(placements(dx.grad())[0], Shard(1));
      EXPECT_TENSOR_CLOSE(full_tensor(dx.grad()), xr.grad(), 1e-10, 1e-10);
    };
    torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({12}));
    ln->to(at::kDouble);
    check("LayerNorm", *ln, [&](const at::Tensor& t) { return ln(t); });
    torch::nn::LayerNorm plain_ln(torch::nn::LayerNormOptions({12}).elementwise_affine(false));
    check("LayerNorm without affine", *plain_ln, [&](const at::Tensor& t) { return plain_ln(t); });
    RMSNormImpl rms(12);
    check("hand-written RMSNorm", rms, [&](const at::Tensor& t) { return rms.forward(t); });
    torch::nn::Module fused;
    fused.register_parameter("weight", at::ones({12}, at::kDouble));
    check("at::rms_norm", fused, [&](const at::Tensor& t) {
      return at::rms_norm(t, {12}, fused.named_parameters()["weight"], 1e-6);
    });
  });
}

TEST(FusedRmsNorm, RulesAreRegisteredForTheCudaOps) {
  // On CPU at::rms_norm decomposes above dtensor; CUDA builds reach the fused ops.
  EXPECT_TRUE(dispatch::has_rule("aten::_fused_rms_norm"));
  EXPECT_TRUE(dispatch::has_rule("aten::_fused_rms_norm_backward"));
}
