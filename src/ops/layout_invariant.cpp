// Layout-invariant matrix products (layout_invariant.h): the canonical segmented sum of a
// product whose contracted dim is sharded, and the rules that choose it while the mode is on.
#include "dtensor/ops/layout_invariant.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <string>
#include <utility>
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

namespace {

// How many of the mode's segments this rank holds of a dim of local length `local_len` split over
// `mesh`'s dim `mesh_dim` (all of them without a mesh), and their length.
std::pair<int64_t, int64_t> my_segments(const DeviceMesh* mesh, int64_t mesh_dim, int64_t local_len,
                                        std::string_view op, const char* what) {
  const int64_t segments = layout_invariant_segments();
  TORCH_CHECK(segments > 0, "dtensor: ", op, ": needs a LayoutInvariantMode");
  const int64_t ranks = mesh ? mesh->size(mesh_dim) : 1;
  TORCH_CHECK(segments % ranks == 0, "dtensor: ", op, " in LayoutInvariantMode(", segments,
              "): the ", what, " is sharded over ", ranks,
              " ranks, which does not divide max_degree ", segments);
  const int64_t mine = segments / ranks;
  TORCH_CHECK(local_len % mine == 0, "dtensor: ", op, " in LayoutInvariantMode(", segments,
              "): the ", what, " (", local_len * ranks, ") does not divide into ", segments,
              " segments");
  return {mine, local_len / mine};
}

// The rest of the tree: this rank's segments, then the ranks' subtotals in rank order.
at::Tensor finish_tree(std::vector<at::Tensor> parts, const DeviceMesh* mesh, int64_t mesh_dim,
                       std::string_view op) {
  at::Tensor out = tree_sum(std::move(parts));
  if (mesh && mesh->size(mesh_dim) > 1)
    out = tree_sum(kernel_all_gather(op, out, *mesh, mesh_dim).unbind(0));
  return out;
}

}  // namespace

at::Tensor canonical_mm(const at::Tensor& a, const at::Tensor& b, const DeviceMesh* mesh,
                        int64_t mesh_dim, std::string_view op) {
  const auto [mine, len] = my_segments(mesh, mesh_dim, a.size(1), op, "contracted dim");
  // The segments are views: their leading dims differ between layouts, which this LibTorch's
  // products do not depend on (bench_kernel_invariance), and copying the weights' segments at
  // every call cost a third of the decode speed.
  std::vector<at::Tensor> parts;
  for (int64_t j = 0; j < mine; ++j)
    parts.push_back(at::mm(a.narrow(1, j * len, len), b.narrow(0, j * len, len)));
  return finish_tree(std::move(parts), mesh, mesh_dim, op);
}

at::Tensor canonical_reduce(const at::Tensor& local, int64_t dim,
                            const std::function<at::Tensor(const at::Tensor&)>& partial,
                            const DeviceMesh* mesh, int64_t mesh_dim, std::string_view op) {
  dim = c10::maybe_wrap_dim(dim, local.dim());
  const auto [mine, len] = my_segments(mesh, mesh_dim, local.size(dim), op, "reduced dim");
  // Copies: a reduction's order may follow its input's strides, which differ between layouts.
  std::vector<at::Tensor> parts;
  for (int64_t j = 0; j < mine; ++j)
    parts.push_back(partial(local.narrow(dim, j * len, len).contiguous()));
  return finish_tree(std::move(parts), mesh, mesh_dim, op);
}

namespace detail {
namespace {

// The placements input `i` has at the local call: the decision's, or as it came.
const Placements& decided_placements(const dispatch::OpCall& call, const dispatch::Decision& d,
                                     size_t i) {
  return i < d.inputs.size() && !d.inputs[i].empty() ? d.inputs[i] : call.input(i).placements();
}

}  // namespace

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
    auto placements_of = [&](size_t i) { return decided_placements(call, d, i); };
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

namespace {

// The mesh dim (at most one) where `base`'s decision leaves a pending sum (or p-norm) because
// the input is sharded on a reduced dim, and that dim.
std::optional<std::pair<int64_t, int64_t>> summed_shard(const dispatch::OpCall& call,
                                                        const dispatch::Decision& d, bool norm) {
  const Placements& in = decided_placements(call, d, 0);
  const Placements& out = *d.outputs[0];
  std::optional<std::pair<int64_t, int64_t>> found;
  for (size_t m = 0; m < out.size(); ++m) {
    const bool pending = norm ? out[m].is_norm_partial() && std::isfinite(out[m].norm_p())
                              : out[m].is_partial() && !out[m].is_norm_partial() &&
                                    out[m].reduce_op() == ReduceOp::Sum;
    if (!pending || !in[m].is_shard()) continue;
    TORCH_CHECK(!found, "dtensor: ", call.name(),
                " in LayoutInvariantMode: a reduced dim is sharded over more than one mesh dim (",
                call.placements_str(), "); only one is supported");
    found = std::pair{static_cast<int64_t>(m), in[m].normalized(call.input(0).ndim()).dim()};
  }
  return found;
}

}  // namespace

dispatch::Rule canonical_reduction_rule(dispatch::Rule base, bool norm) {
  return [base = std::move(base), norm](const dispatch::OpCall& call) {
    dispatch::Decision d = base(call);
    const auto summed = summed_shard(call, d, norm);
    if (!summed) return d;
    const auto [m, dim] = *summed;
    (*d.outputs[0])[m] = Placement::replicate();
    d.local_kernel = [m, dim, norm](const c10::OperatorHandle& op, torch::jit::Stack& stack,
                                    const dispatch::LocalContext& ctx) {
      const size_t n = op.schema().arguments().size();
      const torch::jit::Stack args(stack.end() - static_cast<std::ptrdiff_t>(n), stack.end());
      const at::Tensor self = args[0].toTensor();
      const std::string name = op.schema().name();
      at::Tensor out;
      if (!norm) {
        // The op itself on each segment: sums of segments add up to the sum.
        out = canonical_reduce(
            self, dim,
            [&](const at::Tensor& segment) {
              torch::jit::Stack s = args;
              s[0] = segment;
              op.callBoxed(s);
              return s[0].toTensor();
            },
            &ctx.inputs[0]->mesh(), m, name);
      } else {
        // Sums of |x|^p over the segments (in the op's dtype argument, if any), then the p-th
        // root of their canonical sum.
        const double p = args[1].isNone() ? 2.0 : args[1].toScalar().toDouble();
        std::vector<int64_t> dims;
        bool keepdim = false;
        if (n >= 4 && args[2].isIntList()) dims = args[2].toIntVector();
        if (n >= 4 && args[3].isBool()) keepdim = args[3].toBool();
        const auto dtype_arg = op.schema().argumentIndexWithName("dtype");
        const std::optional<at::ScalarType> dtype =
            dtype_arg && !args[*dtype_arg].isNone() ? std::optional(args[*dtype_arg].toScalarType())
                                                    : std::nullopt;
        out = canonical_reduce(
                  self, dim,
                  [&](const at::Tensor& segment) {
                    const at::Tensor x = dtype ? segment.to(*dtype) : segment;
                    return at::sum(x.abs().pow(p), dims, keepdim);
                  },
                  &ctx.inputs[0]->mesh(), m, name)
                  .pow(1.0 / p);
      }
      torch::jit::drop(stack, n);
      stack.emplace_back(std::move(out));
    };
    return d;
  };
}

}  // namespace detail
}  // namespace dtensor::ops
