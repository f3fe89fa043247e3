// Matrix products as einsum equations (strategy/einsum.h): mm, bmm, dot, mv and their
// bias-adding forms.
#include "dtensor/ops/layout_invariant.h"
#include "dtensor/ops/rule_utils.h"
#include "layout_invariant_rules.h"
#include "strategy/einsum.h"

namespace dtensor::ops {
namespace {

dispatch::Rule einsum_rule(const std::string& eq, bool with_bias = false, bool inplace = false) {
  return [e = einsum::parse_equation(eq), with_bias, inplace](const OpCall& call) {
    auto candidates = einsum::candidates(call, e, with_bias);
    if (inplace) {
      // The written tensor cannot change layout: keep the candidates whose output has it.
      const Placements& self = call.input(0).placements();
      std::erase_if(candidates, [&](const Strategy& s) { return s.outputs[0] != self; });
    }
    Decision d = dispatch::choose(call, candidates);
    d.output_meta = {einsum::product_meta(call, e, with_bias)};
    return d;
  };
}

}  // namespace

DTENSOR_RULES(matrix_ops) {
  using dispatch::register_rule;
  register_rule("aten::mm", einsum_rule("mk,kn->mn"));
  register_rule("aten::bmm", einsum_rule("bmk,bkn->bmn"));
  register_rule("aten::dot", einsum_rule("i,i->"));
  register_rule("aten::mv", einsum_rule("mk,k->m"));
  // addmm(self, mat1, mat2, beta, alpha): self is the bias added to the product.
  register_rule("aten::addmm", einsum_rule("mk,kn->mn", true));
  register_rule("aten::addmm_", einsum_rule("mk,kn->mn", true, true));
  register_rule("aten::baddbmm", einsum_rule("bmk,bkn->bmn", true));
  register_rule("aten::baddbmm_", einsum_rule("bmk,bkn->bmn", true, true));
  register_rule("aten::addmv", einsum_rule("mk,k->m", true));
  register_rule("aten::addmv_", einsum_rule("mk,k->m", true, true));
  // LayoutInvariantMode: a sharded contracted dim is summed in the canonical order.
  using dispatch::register_context_rule;
  register_context_rule("aten::mm", kLayoutInvariantBit,
                        detail::canonical_sum_rule(einsum_rule("mk,kn->mn"), false));
  register_context_rule("aten::addmm", kLayoutInvariantBit,
                        detail::canonical_sum_rule(einsum_rule("mk,kn->mn", true), true));
}

}  // namespace dtensor::ops
