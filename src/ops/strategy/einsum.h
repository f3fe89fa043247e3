#pragma once
// Strategies of products written as einsum equations ("bmk,bkn->bmn", one letter per tensor
// dim). On each mesh dim a product can replicate everything, shard a batch dim of every operand,
// shard a contracting dim of both operands (the output is then a pending sum), or shard a free
// dim of one operand and the output. Candidates are the product of those choices over mesh
// dims, listed in PyTorch's order so that equal-cost ties pick the same layout
// (docs/ARCHITECTURE.md, "Strategy choice").
#include <string>
#include <vector>

#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops::einsum {

// Operands (one or two) and output of an equation, one letter per tensor dim.
struct Equation {
  std::vector<std::string> operands;
  std::string output;
};

Equation parse_equation(const std::string& eq);

// Candidates for the product whose operands are OpCall inputs first_operand, +1, ...; a bias
// (input 0 when with_bias) follows the output through broadcasting. Strategy inputs cover every
// OpCall input. Checks the operands' ranks and that a letter names one size in every operand.
std::vector<Strategy> candidates(const OpCall& call, const Equation& e, bool with_bias);

// Global metadata of the product (contiguous), from its operands' dim sizes.
TensorMeta product_meta(const OpCall& call, const Equation& e, bool with_bias);

}  // namespace dtensor::ops::einsum
