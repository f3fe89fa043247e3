// Sequence-parallel linears with their collectives overlapped with the matmuls
// (docs/ARCHITECTURE.md, "Overlapping communication in sequence-parallel linears").
#include "dtensor/tp/overlap.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <memory>
#include <string>

#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"

namespace dtensor::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a call needs besides tensors: the group, the piece count and the gradient-sum order.
struct OverlapCall : torch::CustomClassHolder {
  std::shared_ptr<comm::ProcessGroup> pg;
  int64_t chunks = 1;
  std::vector<int64_t> order;
};

c10::IValue capsule(std::shared_ptr<comm::ProcessGroup> pg, int64_t chunks,
                    std::vector<int64_t> order = {}) {
  auto call = c10::make_intrusive<OverlapCall>();
  call->pg = std::move(pg);
  call->chunks = chunks;
  call->order = std::move(order);
  return c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(std::move(call)));
}

const OverlapCall& call_of(const c10::IValue& v) {
  return *static_cast<const OverlapCall*>(v.toCapsule().get());
}

// The local weight of a Linear parallelized with `placement` (Shard(0) Colwise, Shard(1)
// Rowwise) on `mesh`, through to_local so that its gradient reaches the parameter.
at::Tensor local_weight(const at::Tensor& weight, const DeviceMesh& mesh, int64_t shard_dim,
                        const char* fn) {
  TORCH_CHECK(weight.defined() && is_dtensor(weight) && weight.dim() == 2, "tp::", fn,
              ": expected a 2-D DTensor Linear weight, got ",
              weight.defined() ? (is_dtensor(weight) ? c10::str(weight.dim(), "-D DTensor")
                                                     : std::string("a plain tensor"))
                               : std::string("an undefined tensor"),
              "; parallelize the Linear first (",
              shard_dim == 0 ? "ColwiseParallel" : "RowwiseParallel", ")");
  const Placements& p = placements(weight);
  TORCH_CHECK(p.size() == 1 && p[0].is_shard(shard_dim) && spec_of(weight).mesh() == mesh,
              "tp::", fn, ": expected the weight as Shard(", shard_dim, ") on mesh ", mesh.str(),
              ", got ", spec_of(weight).str());
  TORCH_CHECK(weight.size(shard_dim) % mesh.size() == 0, "tp::", fn, ": weight dim ", shard_dim,
              " (", weight.size(shard_dim), ") must split evenly over ", mesh.size(), " ranks");
  return to_local(weight);
}

// Sequence shard (B, s, D) -> per weight (B, n*s, out_i): gathered in pieces, each multiplied
// while the next is in flight. Backward: the summed input gradient is reduce-scattered while the
// weight gradients are computed.
struct AllGatherMatmul : torch::autograd::Function<AllGatherMatmul> {
  static variable_list forward(AutogradContext* ctx, c10::IValue call_v, const at::Tensor& x,
                               at::TensorList weights) {
    const OverlapCall& call = call_of(call_v);
    comm::ProcessGroup& pg = *call.pg;
    const int64_t n = pg.size(), c = call.chunks;
    const int64_t B = x.size(0), s = x.size(1), D = x.size(2), blk = s / c;
    at::Tensor full;
    std::vector<at::Tensor> outs(weights.size());
    auto piece = [&](int64_t j) {
      return comm::all_gather_into_tensor_async(c == 1 ? x : x.narrow(1, j * blk, blk), 1, pg);
    };
    if (c == 1) {
      full = piece(0).wait();
      for (size_t i = 0; i < weights.size(); ++i)
        outs[i] = full.reshape({-1, D}).mm(weights[i].t()).view({B, n * s, -1});
    } else {
      // Sequence position r*s + j*blk + t lives in (r, j, t): piece j holds (., j, .) of every r.
      full = at::empty({B, n, c, blk, D}, x.options());
      std::vector<at::Tensor> bufs;
      for (const auto& w : weights)
        bufs.push_back(at::empty({B, n, c, blk, w.size(0)}, x.options()));
      comm::PendingResult next = piece(0);
      for (int64_t j = 0; j < c; ++j) {
        const at::Tensor got = next.wait();  // (B, n*blk, D), rank-major
        if (j + 1 < c) next = piece(j + 1);
        full.select(2, j).copy_(got.view({B, n, blk, D}));
        const at::Tensor rows = got.reshape({-1, D});
        for (size_t i = 0; i < weights.size(); ++i)
          bufs[i].select(2, j).copy_(rows.mm(weights[i].t()).view({B, n, blk, -1}));
      }
      full = full.view({B, n * s, D});
      for (size_t i = 0; i < weights.size(); ++i) outs[i] = bufs[i].view({B, n * s, -1});
    }
    ctx->saved_data["call"] = std::move(call_v);
    std::vector<at::Tensor> saved{full};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const OverlapCall& call = call_of(ctx->saved_data["call"]);
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& full = saved[0];
    const int64_t D = full.size(2), k = static_cast<int64_t>(grads.size());
    std::vector<at::Tensor> g2d(k);
    for (int64_t i = 0; i < k; ++i)
      if (grads[i].defined()) g2d[i] = grads[i].reshape({-1, grads[i].size(-1)});
    // The input gradient: each layer's (B*S, D) contribution, summed as autograd sums them.
    at::Tensor sum;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t w = call.order.empty() ? i : call.order[i];
      if (!g2d[w].defined()) continue;
      at::Tensor part = g2d[w].mm(saved[1 + w]);
      sum = sum.defined() ? sum + part : part;
    }
    comm::PendingResult scattered;
    if (sum.defined())
      scattered =
          comm::reduce_scatter_tensor_async(sum.view(full.sizes()), 1, ReduceOp::Sum, *call.pg);
    // Weight gradients while the reduce-scatter is in flight.
    variable_list out{at::Tensor(), at::Tensor()};
    const at::Tensor rows = full.view({-1, D});
    for (int64_t i = 0; i < k; ++i)
      out.push_back(g2d[i].defined() ? g2d[i].t().mm(rows) : at::Tensor());
    out[1] = scattered.wait();
    return out;
  }
};

// (B, S, in/n) -> this rank's (B, s, out) of the sum: the output pieces are multiplied in turn
// and each reduce-scattered while the next is computed. Backward: one all-gather of the output
// gradient, then both matmuls.
struct MatmulReduceScatter : torch::autograd::Function<MatmulReduceScatter> {
  static variable_list forward(AutogradContext* ctx, c10::IValue call_v, const at::Tensor& x,
                               const at::Tensor& weight) {
    const OverlapCall& call = call_of(call_v);
    comm::ProcessGroup& pg = *call.pg;
    const int64_t n = pg.size(), c = call.chunks;
    const int64_t B = x.size(0), S = x.size(1), H = x.size(2), blk = S / (n * c);
    at::Tensor out;
    if (c == 1) {
      out = comm::reduce_scatter_tensor(x.reshape({-1, H}).mm(weight.t()).view({B, S, -1}), 1,
                                        ReduceOp::Sum, pg);
    } else {
      // Piece j: rows (r, j, .) of every rank r's block, so that its reduce-scatter hands rank r
      // piece j of its own block.
      const at::Tensor pieces = x.reshape({B, n, c, blk, H});
      std::vector<comm::PendingResult> pending;
      for (int64_t j = 0; j < c; ++j) {
        at::Tensor y = pieces.select(2, j).reshape({-1, H}).mm(weight.t()).view({B, n * blk, -1});
        pending.push_back(comm::reduce_scatter_tensor_async(y, 1, ReduceOp::Sum, pg));
      }
      std::vector<at::Tensor> parts;
      for (auto& p : pending) parts.push_back(p.wait());
      out = at::cat(parts, 1);
    }
    ctx->saved_data["call"] = std::move(call_v);
    ctx->save_for_backward({x, weight});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const OverlapCall& call = call_of(ctx->saved_data["call"]);
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor g = comm::all_gather_into_tensor(grads[0], 1, *call.pg);
    const at::Tensor g2d = g.reshape({-1, g.size(-1)});
    const at::Tensor rows = x.reshape({-1, x.size(-1)});
    return {at::Tensor(), g2d.mm(weight).view(x.sizes()), g2d.t().mm(rows)};
  }
};

std::shared_ptr<comm::ProcessGroup> group_of(const DeviceMesh& mesh, const char* fn) {
  TORCH_CHECK(mesh.ndim() == 1, "tp::", fn,
              ": expected a 1-D mesh (slice mesh[\"tp\"] first), got ", mesh.str());
  return mesh.get_group(0);
}

}  // namespace

int64_t overlap_chunks(int64_t local_seq, int64_t chunks) {
  int64_t c = std::max<int64_t>(1, std::min(chunks, local_seq));
  while (c > 1 && local_seq % c != 0) --c;
  return c;
}

std::vector<at::Tensor> all_gather_matmul(const at::Tensor& x,
                                          const std::vector<at::Tensor>& weights,
                                          const DeviceMesh& mesh, int64_t chunks,
                                          const std::vector<int64_t>& grad_sum_order) {
  auto pg = group_of(mesh, "all_gather_matmul");
  TORCH_CHECK(!weights.empty(), "tp::all_gather_matmul: no weights given");
  TORCH_CHECK(grad_sum_order.empty() || grad_sum_order.size() == weights.size(),
              "tp::all_gather_matmul: grad_sum_order has ", grad_sum_order.size(), " entries for ",
              weights.size(), " weights");
  at::Tensor local = x;
  if (is_dtensor(x)) {
    const Placements& p = placements(x);
    TORCH_CHECK(p.size() == 1 && p[0].normalized(x.dim()).is_shard(1) && spec_of(x).mesh() == mesh,
                "tp::all_gather_matmul: expected the input as this rank's sequence shard "
                "(Shard(1) on ",
                mesh.str(), "), got ", spec_of(x).str());
    TORCH_CHECK(x.size(1) % mesh.size() == 0, "tp::all_gather_matmul: the sequence length ",
                x.size(1), " must be divisible by the ", mesh.size(), " ranks");
    local = to_local(x);
  }
  TORCH_CHECK(local.dim() == 3,
              "tp::all_gather_matmul: expected the input as (batch, sequence, "
              "features), got ",
              local.dim(), " dims");
  std::vector<at::Tensor> locals;
  for (const auto& w : weights) {
    locals.push_back(local_weight(w, mesh, 0, "all_gather_matmul"));
    TORCH_CHECK(w.size(1) == local.size(2), "tp::all_gather_matmul: weight of shape ", w.sizes(),
                " does not take ", local.size(2), " input features");
  }
  // As a TensorList: a std::vector argument would not count as the Function's inputs.
  return AllGatherMatmul::apply(capsule(pg, overlap_chunks(local.size(1), chunks), grad_sum_order),
                                local, at::TensorList(locals));
}

at::Tensor matmul_reduce_scatter(const at::Tensor& x, const at::Tensor& weight,
                                 const DeviceMesh& mesh, int64_t chunks) {
  auto pg = group_of(mesh, "matmul_reduce_scatter");
  TORCH_CHECK(!is_dtensor(x) && x.dim() == 3,
              "tp::matmul_reduce_scatter: expected the local input features as a plain "
              "(batch, sequence, features) tensor, got ",
              is_dtensor(x) ? "a DTensor" : c10::str(x.dim(), " dims"));
  const int64_t n = mesh.size();
  TORCH_CHECK(x.size(1) % n == 0, "tp::matmul_reduce_scatter: the sequence length ", x.size(1),
              " must be divisible by the ", n, " ranks");
  const at::Tensor w = local_weight(weight, mesh, 1, "matmul_reduce_scatter");
  TORCH_CHECK(w.size(1) == x.size(2), "tp::matmul_reduce_scatter: the local weight takes ",
              w.size(1), " input features, the input has ", x.size(2));
  return MatmulReduceScatter::apply(capsule(pg, overlap_chunks(x.size(1) / n, chunks)), x, w)[0];
}

}  // namespace dtensor::tp
