#include "einsum.h"

#include <algorithm>
#include <optional>
#include <set>

namespace dtensor::ops::einsum {
namespace {

// Shard(position of `c` in `dims`), or Replicate when the tensor has no such dim.
Placement shard_letter(const std::string& dims, char c) {
  const auto pos = dims.find(c);
  return pos == std::string::npos ? Replicate() : Shard(static_cast<int64_t>(pos));
}

// The choices for one mesh dim: all Replicate, then every batch dim, contracting dim,
// lhs-only and rhs-only free dim, each group in alphabetical order.
std::vector<DimStrategy> single_dim_choices(const Equation& e) {
  std::set<char> letters;  // sorted, as PyTorch sorts the dim letters
  for (const auto& op : e.operands) letters.insert(op.begin(), op.end());
  auto in_output = [&](char c) { return e.output.find(c) != std::string::npos; };
  auto in_all = [&](char c) {
    return std::all_of(e.operands.begin(), e.operands.end(),
                       [c](const std::string& op) { return op.find(c) != std::string::npos; });
  };
  auto choice = [&](Placement out) {
    DimStrategy d(e.operands.size() + 1, Replicate());
    d[0] = out;
    return d;
  };
  std::vector<DimStrategy> out{choice(Replicate())};
  for (char c : letters) {
    if (!in_output(c) || !in_all(c)) continue;
    DimStrategy d = choice(shard_letter(e.output, c));
    for (size_t j = 0; j < e.operands.size(); ++j) d[j + 1] = shard_letter(e.operands[j], c);
    out.push_back(std::move(d));
  }
  for (char c : letters) {
    if (in_output(c)) continue;
    DimStrategy d = choice(Partial());
    for (size_t j = 0; j < e.operands.size(); ++j) d[j + 1] = shard_letter(e.operands[j], c);
    out.push_back(std::move(d));
  }
  for (size_t side = 0; side < e.operands.size(); ++side) {
    for (char c : letters) {
      if (!in_output(c) || in_all(c) || e.operands[side].find(c) == std::string::npos) continue;
      DimStrategy d = choice(shard_letter(e.output, c));
      d[side + 1] = shard_letter(e.operands[side], c);
      out.push_back(std::move(d));
    }
  }
  return out;
}

}  // namespace

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

std::vector<Strategy> candidates(const OpCall& call, const Equation& e, bool with_bias) {
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
  // Per mesh dim: [output, bias?, operands...].
  std::vector<DimStrategy> choices = single_dim_choices(e);
  if (with_bias) {
    for (auto& c : choices) {
      const Placements bias = remap_shards({c[0]}, [&](int64_t d) { return bias_dim_of_out[d]; });
      c.insert(c.begin() + 1, bias[0]);
    }
  }
  return expand_to_mesh(call, choices, 1);
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

}  // namespace dtensor::ops::einsum
