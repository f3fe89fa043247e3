#pragma once
// Small float64 mixture-of-experts blocks for the parallel tests (tests/models/test_moe.cpp,
// test_expert_parallel.cpp), and their comparison with a one-device reference.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "dtensor/models/moe.h"
#include "support/model_compare.h"

namespace dtensor::testing {

// A block of `options` in float64 (dim 32, experts' width 16) with every parameter drawn from
// `seed` (biases too).
inline models::MoE seeded_block(const models::MoeOptions& options, uint64_t seed) {
  at::manual_seed(seed);
  models::MoE moe(/*dim=*/32, /*hidden_dim=*/16, options);
  moe->to(at::kDouble);
  at::NoGradGuard no_grad;
  for (auto& p : moe->named_parameters()) p.value().normal_(0.0, 0.3);
  return moe;
}

// Every parameter's gradient (after_step false) or value of the parallelized `moe` equals the
// one-device `ref`'s within 1e-9.
inline void expect_like_one_device(const models::MoE& moe, const models::MoE& ref,
                                   bool after_step) {
  const auto rp = params_of(*ref);
  for (const auto& [name, p] : params_of(*moe)) {
    if (after_step) {
      EXPECT_TRUE(close_to_scale(whole(p), rp.at(name), 1e-9)) << name << " after step";
      continue;
    }
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_TRUE(close_to_scale(whole(p.grad()), rp.at(name).grad(), 1e-9)) << name << " gradient";
  }
}

// A Qwen3-MoE-like block (8 experts, top 2, renormalised) and a gpt-oss-like one (4 experts,
// routing over the top logits, router and expert biases, clamped SwiGLU with a small limit so
// that the clamps bite).
inline std::vector<models::MoeOptions> moe_variants() {
  using namespace models;
  return {{.num_experts = 8, .top_k = 2, .renormalize = true},
          {.num_experts = 4,
           .top_k = 2,
           .scoring = RouterScoring::kTopKThenSoftmax,
           .router_bias = true,
           .expert_bias = true,
           .activation = ExpertActivation::kClampedSwiGLU,
           .swiglu_limit = 0.5}};
}

}  // namespace dtensor::testing
