// Layout-invariant matrix products (layout_invariant.h): the canonical segmented sum of a
// product whose contracted dim is sharded, and the rules that choose it while the mode is on.
#include "dtensor/ops/layout_invariant.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "dtensor/ops/kernel_collectives.h"
#include "layout_invariant_rules.h"

namespace dtensor::ops {
namespace {

thread_local int64_t tl_segments = 0;

bool is_power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// Adds neighbours pairwise until one is left: ((s0 + s1) + (s2 + s3)) for four. A rank holding a
// power-of-two run of segments aligned to its size computes one subtree of the whole tree.
at::Tensor tree_sum(std::vector<at::Tensor> parts) {
  while (parts.size() > 1) {
    std::vector<at::Tensor> next;
    for (size_t i = 0; i + 1 < parts.size(); i += 2) next.push_back(parts[i] + parts[i + 1]);
    if (parts.size() % 2 == 1) next.push_back(parts.back());
    parts = std::move(next);
  }
  return parts.front();
}

}  // namespace

int64_t layout_invariant_segments() { return tl_segments; }

LayoutInvariantMode::LayoutInvariantMode(int64_t max_degree)
    : guard_(kLayoutInvariantBit), prev_(tl_segments) {
  TORCH_CHECK(is_power_of_two(max_degree),
              "dtensor: LayoutInvariantMode needs max_degree a power of two, got ", max_degree);
  tl_segments = max_degree;
}

LayoutInvariantMode::~LayoutInvariantMode() { tl_segments = prev_; }

at::Tensor canonical_mm(const at::Tensor& a, const at::Tensor& b, const DeviceMesh* mesh,
                        int64_t mesh_dim, std::string_view op) {
  const int64_t segments = layout_invariant_segments();
  TORCH_CHECK(segments > 0, "dtensor: ", op, ": canonical_mm needs a LayoutInvariantMode");
  const int64_t ranks = mesh ? mesh->size(mesh_dim) : 1;
  TORCH_CHECK(segments % ranks == 0, "dtensor: ", op, " in LayoutInvariantMode(", segments,
              "): the contracted dim is sharded over ", ranks,
              " ranks, which does not divide max_degree ", segments);
  const int64_t mine = segments / ranks, k = a.size(1);
  TORCH_CHECK(k % mine == 0, "dtensor: ", op, " in LayoutInvariantMode(", segments,
              "): the contracted dim (", k * ranks, ") does not divide into ", segments,
              " segments");
  const int64_t len = k / mine;
  // The segments are views: their leading dims differ between layouts, which this LibTorch's
  // products do not depend on (bench_kernel_invariance), and copying the weights' segments at
  // every call cost a third of the decode speed.
  std::vector<at::Tensor> parts;
  for (int64_t j = 0; j < mine; ++j)
    parts.push_back(at::mm(a.narrow(1, j * len, len), b.narrow(0, j * len, len)));
  at::Tensor out = tree_sum(std::move(parts));
  if (ranks > 1) out = tree_sum(kernel_all_gather(op, out, *mesh, mesh_dim).unbind(0));
  return out;
}

namespace detail {

void canonical_matmul(const c10::OperatorHandle& op, torch::jit::Stack& stack,
                      const dispatch::LocalContext& ctx, int64_t mesh_dim, bool with_bias) {
  const size_t first = with_bias ? 1 : 0;
  const size_t base = stack.size() - (with_bias ? 5 : 2);
  at::Tensor out = canonical_mm(stack[base + first].toTensor(), stack[base + first + 1].toTensor(),
                                &ctx.inputs[first]->mesh(), mesh_dim, op.schema().name());
  if (with_bias) {
    const c10::Scalar beta = stack[base + 3].toScalar(), alpha = stack[base + 4].toScalar();
    if (!(alpha.equal(1))) out = out * alpha;
    const at::Tensor bias = stack[base].toTensor();
    out = out + (beta.equal(1) ? bias : bias * beta);
  }
  torch::jit::drop(stack, with_bias ? 5 : 2);
  stack.emplace_back(std::move(out));
}

dispatch::Rule canonical_sum_rule(dispatch::Rule base, bool with_bias) {
  return [base = std::move(base), with_bias](const dispatch::OpCall& call) {
    dispatch::Decision d = base(call);
    const size_t first = with_bias ? 1 : 0;
    auto placements_of = [&](size_t i) -> const Placements& {
      return i < d.inputs.size() && !d.inputs[i].empty() ? d.inputs[i] : call.input(i).placements();
    };
    Placements& out = *d.outputs[0];
    std::vector<int64_t> summed;
    for (size_t m = 0; m < out.size(); ++m) {
      if (out[m].is_partial() && placements_of(first)[m].normalized(2).is_shard(1) &&
          placements_of(first + 1)[m].normalized(2).is_shard(0))
        summed.push_back(static_cast<int64_t>(m));
    }
    if (summed.empty()) return d;
    TORCH_CHECK(summed.size() == 1, "dtensor: ", call.name(),
                " in LayoutInvariantMode: the contracted dim is sharded over more than one mesh "
                "dim (",
                call.placements_str(), "); only one is supported");
    const int64_t m = summed.front();
    out[m] = Placement::replicate();
    if (with_bias) {
      // The bias is added after the whole sum, so every rank needs all of it.
      Placements bias = placements_of(0);
      bias[m] = Placement::replicate();
      d.inputs.resize(call.num_inputs());
      d.inputs[0] = bias;
    }
    d.local_kernel = [m, with_bias](const c10::OperatorHandle& op, torch::jit::Stack& stack,
                                    const dispatch::LocalContext& ctx) {
      canonical_matmul(op, stack, ctx, m, with_bias);
    };
    return d;
  };
}

}  // namespace detail
}  // namespace dtensor::ops
