// Matrix products as einsum equations. On each mesh dim a product can replicate everything, shard a
// batch dim of every operand, shard a contracting dim of both operands (the output is then a
// pending sum), or shard a free dim of one operand and the output. Candidates are the product of
// those choices over mesh dims, listed in PyTorch's order so that equal-cost ties pick the same
// layout (docs/ARCHITECTURE.md, "Strategy choice").
#include <set>

#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

using dispatch::Strategy;

// Operands and output of an equation such as "bmk,bkn->bmn", one letter per tensor dim.
struct Equation {
  std::vector<std::string> operands;
  std::string output;
};

Equation parse_equation(const std::string& eq) {
  const auto arrow = eq.find("->");
  TORCH_INTERNAL_ASSERT(arrow != std::string::npos, "einsum equation without '->': ", eq);
  Equation e;
  e.output = eq.substr(arrow + 2);
  const std::string lhs = eq.substr(0, arrow);
  size_t start = 0;
  while (true) {
    const auto comma = lhs.find(',', start);
    e.operands.push_back(lhs.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  TORCH_INTERNAL_ASSERT(e.operands.size() <= 2, "einsum strategies take one or two operands");
  return e;
}

// Placements on one mesh dim: the output's, then each operand's.
using DimChoice = std::vector<Placement>;

// Shard(position of `c` in `dims`), or Replicate when the tensor has no such dim.
Placement shard_letter(const std::string& dims, char c) {
  const auto pos = dims.find(c);
  return pos == std::string::npos ? Replicate() : Shard(static_cast<int64_t>(pos));
}

// The choices for one mesh dim: all Replicate, then every batch dim, contracting dim,
// lhs-only and rhs-only free dim, each group in alphabetical order.
std::vector<DimChoice> single_dim_choices(const Equation& e) {
  std::set<char> letters;  // sorted, as PyTorch sorts the dim letters
  for (const auto& op : e.operands) letters.insert(op.begin(), op.end());
  auto in_output = [&](char c) { return e.output.find(c) != std::string::npos; };
  auto in_all = [&](char c) {
    return std::all_of(e.operands.begin(), e.operands.end(),
                       [c](const std::string& op) { return op.find(c) != std::string::npos; });
  };
  auto choice = [&](Placement out) {
    DimChoice d(e.operands.size() + 1, Replicate());
    d[0] = out;
    return d;
  };
  std::vector<DimChoice> out{choice(Replicate())};
  for (char c : letters) {
    if (!in_output(c) || !in_all(c)) continue;
    DimChoice d = choice(shard_letter(e.output, c));
    for (size_t j = 0; j < e.operands.size(); ++j) d[j + 1] = shard_letter(e.operands[j], c);
    out.push_back(std::move(d));
  }
  for (char c : letters) {
    if (in_output(c)) continue;
    DimChoice d = choice(Partial());
    for (size_t j = 0; j < e.operands.size(); ++j) d[j + 1] = shard_letter(e.operands[j], c);
    out.push_back(std::move(d));
  }
  for (size_t side = 0; side < e.operands.size(); ++side) {
    for (char c : letters) {
      if (!in_output(c) || in_all(c) || e.operands[side].find(c) == std::string::npos) continue;
      DimChoice d = choice(shard_letter(e.output, c));
      d[side + 1] = shard_letter(e.operands[side], c);
      out.push_back(std::move(d));
    }
  }
  return out;
}

// True when no dim of `shape` is split into more shards than it has elements.
bool shardable(const DeviceMesh& mesh, c10::IntArrayRef shape, c10::ArrayRef<Placement> p) {
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shards_of_dim(mesh, p, static_cast<int64_t>(d)) > shape[d]) return false;
  }
  return true;
}

// Candidates for the product whose operands are OpCall inputs first_operand, +1, ...;
// a bias (input 0 when with_bias) follows the output through broadcasting. Strategy
// inputs cover every OpCall input.
std::vector<Strategy> einsum_candidates(const OpCall& call, const Equation& e, bool with_bias) {
  const size_t first = with_bias ? 1 : 0;
  TORCH_CHECK(call.num_inputs() == first + e.operands.size(), call.name(), ": expected ",
              first + e.operands.size(), " tensor inputs, got ", call.num_inputs());
  for (size_t j = 0; j < e.operands.size(); ++j) {
    TORCH_CHECK(call.input(first + j).ndim() == static_cast<int64_t>(e.operands[j].size()),
                call.name(), ": operand ", j, " has ", call.input(first + j).ndim(),
                " dims, expected ", e.operands[j].size());
  }
  // A letter names one size in every operand (dot and mv have no meta kernel to check it).
  for (char c : std::set<char>(e.operands[0].begin(), e.operands[0].end())) {
    for (size_t j = 1; j < e.operands.size(); ++j) {
      const auto a = e.operands[0].find(c), b = e.operands[j].find(c);
      if (b == std::string::npos) continue;
      TORCH_CHECK_VALUE(call.input(first).shape()[a] == call.input(first + j).shape()[b],
                        call.name(), ": the global shapes of its operands ", call.placements_str(),
                        " disagree on the size of dim '", c, "' (", call.input(first).shape()[a],
                        " vs ", call.input(first + j).shape()[b], ")");
    }
  }
  const std::vector<DimChoice> choices = single_dim_choices(e);
  const int64_t mesh_nd = call.mesh_ndim();
  const DeviceMesh& mesh = call.mesh();

  // The bias is aligned to the output's trailing dims; a dim it lacks or has as size 1
  // broadcasts, so a shard of that output dim leaves the bias replicated.
  std::vector<std::optional<int64_t>> bias_dim_of_out(e.output.size());
  if (with_bias) {
    const auto& bias = call.input(0).shape();
    const int64_t pad = static_cast<int64_t>(e.output.size()) - static_cast<int64_t>(bias.size());
    for (int64_t o = 0; o < static_cast<int64_t>(e.output.size()); ++o) {
      const int64_t b = o - pad;
      if (b >= 0 && bias[b] != 1) bias_dim_of_out[o] = b;
    }
  }

  std::vector<Strategy> out;
  std::vector<size_t> pick(mesh_nd, 0);  // mixed-radix counter, mesh dim 0 slowest
  while (true) {
    Strategy s;
    Placements outp;
    std::vector<Placements> operands(e.operands.size());
    for (int64_t m = 0; m < mesh_nd; ++m) {
      const DimChoice& c = choices[pick[m]];
      outp.push_back(c[0]);
      for (size_t j = 0; j < e.operands.size(); ++j) operands[j].push_back(c[j + 1]);
    }
    bool ok = true;
    for (size_t j = 0; j < e.operands.size() && ok; ++j) {
      ok = shardable(mesh, call.input(first + j).shape(), operands[j]);
    }
    if (ok) {
      if (with_bias) {
        s.inputs.push_back(remap_shards(outp, [&](int64_t d) { return bias_dim_of_out[d]; }));
      }
      for (auto& p : operands) s.inputs.push_back(std::move(p));
      s.outputs.push_back(std::move(outp));
      out.push_back(std::move(s));
    }
    int64_t m = mesh_nd - 1;
    while (m >= 0 && ++pick[m] == choices.size()) pick[m--] = 0;
    if (m < 0) break;
  }
  return out;
}

// Global shape of the product from its operands' dim sizes (dot and mv have no meta
// kernels); the CPU and CUDA kernels return it contiguous.
TensorMeta product_meta(const OpCall& call, const Equation& e, bool with_bias) {
  const size_t first = with_bias ? 1 : 0;
  std::vector<int64_t> shape;
  for (char c : e.output) {
    for (size_t j = 0; j < e.operands.size(); ++j) {
      const auto pos = e.operands[j].find(c);
      if (pos == std::string::npos) continue;
      shape.push_back(call.input(first + j).shape()[pos]);
      break;
    }
  }
  auto stride = default_strides(shape);
  return TensorMeta{std::move(shape), std::move(stride), call.input(first).dtype()};
}

dispatch::Rule einsum_rule(const std::string& eq, bool with_bias = false, bool inplace = false) {
  return [e = parse_equation(eq), with_bias, inplace](const OpCall& call) {
    auto candidates = einsum_candidates(call, e, with_bias);
    if (inplace) {
      // The written tensor cannot change layout: keep the candidates whose output has it.
      const Placements& self = call.input(0).placements();
      std::erase_if(candidates, [&](const Strategy& s) { return s.outputs[0] != self; });
    }
    Decision d = dispatch::choose(call, candidates);
    d.output_meta = {product_meta(call, e, with_bias)};
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
}

}  // namespace dtensor::ops
