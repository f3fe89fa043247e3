// Attention under context parallelism, by all-gather or by ring (context_attention.h).
#include "dtensor/cp/context_attention.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>
#include <vector>

#include "attention_plan.h"
#include "block_attention.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/ops/layout_invariant.h"

namespace dtensor::cp {

const char* rotate_method_name(RotateMethod m) {
  return m == RotateMethod::all_gather ? "all_gather" : "ring";
}

RotateMethod parse_rotate_method(const std::string& name) {
  if (name == "all_gather") return RotateMethod::all_gather;
  TORCH_CHECK_VALUE(name == "ring", "cp: unknown rotate method '", name,
                    "'; expected all_gather or ring");
  return RotateMethod::ring;
}

namespace {

using detail::AttentionPlan;
using detail::BlockTask;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kKeyValueTag = 0;  // ring messages carrying key/value blocks
constexpr int kGradientTag = 1;  // ring messages carrying key/value gradients

// What a call needs besides tensors.
struct AttentionCall : torch::CustomClassHolder {
  std::shared_ptr<comm::ProcessGroup> pg;
  AttentionPlan plan;
  ContextAttentionOptions options;
  int64_t local_len = 0;
};

const AttentionCall& call_of(const c10::IValue& v) {
  return *static_cast<const AttentionCall*>(v.toCapsule().get());
}

// The accumulators' dtype: reduced floating types accumulate in float.
at::ScalarType accumulate_type(at::ScalarType t) {
  return at::isReducedFloatingType(t) ? at::kFloat : t;
}

// t's batch rows the task names (every row when it names none).
at::Tensor pick(const at::Tensor& t, const BlockTask& task) {
  if (task.rows.empty()) return t;
  return t.index_select(0, at::tensor(task.rows, at::TensorOptions(at::kLong)).to(t.device()));
}

// Writes (or adds) `value` into the task's rows of `dst` (a view of the slots it covers).
void put(at::Tensor dst, const BlockTask& task, const at::Tensor& value, bool add) {
  const at::Tensor v = value.to(dst.scalar_type());
  if (task.rows.empty()) {
    add ? dst.add_(v) : dst.copy_(v);
    return;
  }
  const at::Tensor rows = at::tensor(task.rows, at::TensorOptions(at::kLong)).to(dst.device());
  add ? dst.index_add_(0, rows, v) : dst.index_copy_(0, rows, v);
}

// The task's queries (b, Hq, q_len, D) of qh (B, Hq, n, D).
at::Tensor task_rows(const at::Tensor& heads_first, const BlockTask& task) {
  return pick(heads_first.narrow(2, task.q_slot, task.q_len), task);
}

// The task's keys or values (b, Hq, k_len, D) from a block (B, n, Hkv, D), KV heads repeated.
at::Tensor task_keys(const at::Tensor& block, const BlockTask& task, int64_t rep) {
  return detail::repeat_heads(pick(block.narrow(1, task.k_slot, task.k_len), task).transpose(1, 2),
                              rep);
}

// A key/value source for step j: the block of rank (rank - j) mod cp, as (2, B, n, Hkv, D).
struct Step {
  const std::vector<BlockTask>& tasks;
  at::Tensor kv;
};

// Forward of step j's tasks, merged into (acc_out, acc_lse).
void forward_step(const Step& step, const at::Tensor& qh, int64_t rep, const AttentionCall& call,
                  at::Tensor& acc_out, at::Tensor& acc_lse) {
  for (const BlockTask& task : step.tasks) {
    auto [out, lse] = detail::block_forward(task_rows(qh, task), task_keys(step.kv[0], task, rep),
                                            task_keys(step.kv[1], task, rep), task,
                                            call.options.window, call.options.scale);
    at::Tensor o = acc_out.narrow(2, task.q_slot, task.q_len);
    at::Tensor l = acc_lse.narrow(2, task.q_slot, task.q_len);
    auto [mo, ml] = detail::merge_blocks(pick(o, task), pick(l, task), out, lse);
    put(o, task, mo, /*add=*/false);
    put(l, task, ml, /*add=*/false);
  }
}

// Backward of step j's tasks: adds into dq (B, Hq, n, D) and dkv (2, B, n, Hkv, D).
void backward_step(const Step& step, const at::Tensor& qh, const at::Tensor& grad,
                   const at::Tensor& out, const at::Tensor& lse, int64_t rep,
                   const AttentionCall& call, at::Tensor& dq, at::Tensor& dkv) {
  for (const BlockTask& task : step.tasks) {
    auto [gq, gk, gv] = detail::block_backward(
        task_rows(grad, task), task_rows(qh, task), task_keys(step.kv[0], task, rep),
        task_keys(step.kv[1], task, rep), task_rows(out, task),
        pick(lse.narrow(2, task.q_slot, task.q_len), task), task, call.options.window,
        call.options.scale);
    put(dq.narrow(2, task.q_slot, task.q_len), task, gq, /*add=*/true);
    put(dkv[0].narrow(1, task.k_slot, task.k_len), task,
        detail::sum_head_groups(gk, rep).transpose(1, 2), /*add=*/true);
    put(dkv[1].narrow(1, task.k_slot, task.k_len), task,
        detail::sum_head_groups(gv, rep).transpose(1, 2), /*add=*/true);
  }
}

// Posts passing `t` to the next rank of the ring and receiving the previous rank's.
std::pair<comm::PendingResult, comm::PendingResult> rotate(const at::Tensor& t,
                                                           comm::ProcessGroup& pg, int tag) {
  const int cp = pg.size(), r = pg.rank();
  comm::PendingResult recv = comm::irecv(t, (r - 1 + cp) % cp, pg, tag);
  comm::PendingResult send = comm::isend(t, (r + 1) % cp, pg, tag);
  return {std::move(send), std::move(recv)};
}

struct ContextAttentionFunction : torch::autograd::Function<ContextAttentionFunction> {
  static variable_list forward(AutogradContext* ctx, c10::IValue call_v, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v) {
    const AttentionCall& call = call_of(call_v);
    comm::ProcessGroup& pg = *call.pg;
    const int64_t cp = pg.size(), r = pg.rank(), n = call.local_len;
    const int64_t B = q.size(0), Hq = q.size(2), D = q.size(3), rep = Hq / k.size(2);
    const at::Tensor qh = q.transpose(1, 2);
    at::Tensor acc_out =
        at::zeros({B, Hq, n, D}, q.options().dtype(accumulate_type(q.scalar_type())));
    at::Tensor acc_lse =
        at::full({B, Hq, n}, -std::numeric_limits<double>::infinity(), acc_out.options());
    at::Tensor kv = at::stack({k, v});
    at::Tensor gathered;  // all_gather: every rank's blocks, (2, B, cp * n, Hkv, D)
    if (call.options.rotate == RotateMethod::all_gather && cp > 1) {
      gathered = at::stack(
          {comm::all_gather_into_tensor(k, 1, pg), comm::all_gather_into_tensor(v, 1, pg)});
    }
    std::vector<comm::PendingResult> sends;
    for (int64_t j = 0; j < cp; ++j) {
      const int64_t src = ((r - j) % cp + cp) % cp;
      std::optional<comm::PendingResult> next;
      if (gathered.defined()) {
        kv = gathered.narrow(2, src * n, n);
      } else if (j + 1 < cp) {
        auto [send, recv] = rotate(kv, pg, kKeyValueTag);
        sends.push_back(std::move(send));
        next = std::move(recv);
      }
      forward_step({call.plan.steps[j], kv}, qh, rep, call, acc_out, acc_lse);
      if (next) kv = next->wait();
    }
    for (auto& s : sends) s.wait();
    const at::Tensor out = acc_out.to(q.scalar_type());
    // A query that sees no key (padding) contributes nothing in backward: e^(s - inf) = 0.
    const at::Tensor lse =
        acc_lse.masked_fill(acc_lse.isneginf(), std::numeric_limits<double>::infinity());
    ctx->saved_data["call"] = std::move(call_v);
    ctx->save_for_backward({q, k, v, out, lse, gathered});
    return {out.transpose(1, 2).reshape({B, n, Hq * D})};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const AttentionCall& call = call_of(ctx->saved_data["call"]);
    comm::ProcessGroup& pg = *call.pg;
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4],
                     &gathered = saved[5];
    const int64_t cp = pg.size(), r = pg.rank(), n = call.local_len;
    const int64_t B = q.size(0), Hq = q.size(2), D = q.size(3), rep = Hq / k.size(2);
    const at::Tensor qh = q.transpose(1, 2);
    const at::Tensor grad = grads[0].reshape({B, n, Hq, D}).transpose(1, 2).to(q.scalar_type());
    const auto acc = q.options().dtype(accumulate_type(q.scalar_type()));
    at::Tensor dq = at::zeros({B, Hq, n, D}, acc);
    at::Tensor dk, dv;
    if (gathered.defined()) {
      // Gradients of every rank's keys and values, reduce-scattered back to their owners.
      at::Tensor dkv = at::zeros(gathered.sizes(), acc);
      for (int64_t j = 0; j < cp; ++j) {
        const int64_t src = ((r - j) % cp + cp) % cp;
        at::Tensor block = dkv.narrow(2, src * n, n);
        backward_step({call.plan.steps[j], gathered.narrow(2, src * n, n)}, qh, grad, out, lse, rep,
                      call, dq, block);
      }
      dk = comm::reduce_scatter_tensor(dkv[0], 1, ReduceOp::Sum, pg);
      dv = comm::reduce_scatter_tensor(dkv[1], 1, ReduceOp::Sum, pg);
    } else {
      // The blocks go round again; each block's gradient travels with it, gathering every
      // rank's share, and reaches its owner one exchange after the last.
      at::Tensor kv = at::stack({k, v});
      std::vector<comm::PendingResult> sends;
      std::optional<comm::PendingResult> arriving;  // the gradient of the block coming next
      at::Tensor mine;
      for (int64_t j = 0; j < cp; ++j) {
        std::optional<comm::PendingResult> next;
        if (j + 1 < cp) {
          auto [send, recv] = rotate(kv, pg, kKeyValueTag);
          sends.push_back(std::move(send));
          next = std::move(recv);
        }
        at::Tensor dkv = at::zeros(kv.sizes(), acc);
        backward_step({call.plan.steps[j], kv}, qh, grad, out, lse, rep, call, dq, dkv);
        if (arriving) dkv.add_(arriving->wait());
        if (cp == 1) {
          mine = dkv;
        } else {
          auto [send, recv] = rotate(dkv, pg, kGradientTag);
          sends.push_back(std::move(send));
          arriving = std::move(recv);
        }
        if (next) kv = next->wait();
      }
      if (arriving) mine = arriving->wait();
      for (auto& s : sends) s.wait();
      dk = mine[0];
      dv = mine[1];
    }
    return {at::Tensor(), dq.transpose(1, 2).to(q.scalar_type()), dk.to(k.scalar_type()),
            dv.to(v.scalar_type())};
  }
};

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const ContextLayout& layout, const comm::ProcessGroup& pg,
                  const ContextAttentionOptions& options) {
  TORCH_CHECK(
      q.defined() && k.defined() && v.defined() && q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
      "cp::context_attention: expected q (B, n, Hq, D), k and v (B, n, Hkv, D)");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                  q.size(3) == k.size(3),
              "cp::context_attention: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " do not agree on batch, slots and head_dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "cp::context_attention: q, k and v must share a dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, "cp::context_attention: ", q.size(2),
              " query heads cannot share ", k.size(2), " KV heads evenly");
  TORCH_CHECK(pg.size() == layout.cp_size(), "cp::context_attention: the cp group ", pg.name(),
              " has ", pg.size(), " ranks but the layout splits over cp = ", layout.cp_size());
  TORCH_CHECK(q.size(0) == layout.batch() && q.size(1) == layout.local_len(),
              "cp::context_attention: q has batch ", q.size(0), " and ", q.size(1),
              " slots per rank, but the layout has ", layout.batch(), " rows of ",
              layout.local_len(), " slots per rank (", layout.seq_len(),
              " tokens over cp = ", layout.cp_size(), ")");
  TORCH_CHECK_VALUE(options.window >= 0,
                    "cp::context_attention: window must be >= 0 (0: none), got ", options.window);
  TORCH_CHECK_NOT_IMPLEMENTED(
      ops::layout_invariant_segments() == 0,
      "cp::context_attention: the layout-invariant mode is not supported under context "
      "parallelism (a query's bits would depend on how the keys are cut into blocks)");
}

}  // namespace

at::Tensor context_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const ContextLayout& layout,
                             const std::shared_ptr<comm::ProcessGroup>& cp_group,
                             const ContextAttentionOptions& options) {
  TORCH_CHECK(cp_group, "cp::context_attention: no cp process group");
  check_inputs(q, k, v, layout, *cp_group, options);
  auto call = c10::make_intrusive<AttentionCall>();
  call->pg = cp_group;
  call->plan = detail::plan_attention(layout, cp_group->rank(), options.window);
  call->options = options;
  call->local_len = layout.local_len();
  c10::IValue capsule =
      c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(std::move(call)));
  return ContextAttentionFunction::apply(std::move(capsule), q, k, v)[0];
}

at::Tensor context_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const ContextLayout& layout, const std::string& cp_dim,
                             const ContextAttentionOptions& options) {
  TORCH_CHECK(is_dtensor(q) && is_dtensor(k) && is_dtensor(v),
              "cp::context_attention: expected q, k and v as DTensors (or call the overload that "
              "takes local tensors and the cp process group)");
  const DeviceMesh& mesh = device_mesh(q);
  TORCH_CHECK(device_mesh(k) == mesh && device_mesh(v) == mesh,
              "cp::context_attention: q, k and v must be on one mesh");
  const int64_t dim = mesh.dim_index(cp_dim);
  const Placements p = placements(q);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(placements(*t) == p,
                "cp::context_attention: q, k and v must share placements, got ", spec_of(q).str(),
                " and ", spec_of(*t).str());
  }
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    if (i == dim) {
      TORCH_CHECK(p[i].is_shard(1),
                  "cp::context_attention: expected Shard(1) (the sequence) on "
                  "mesh dim '",
                  cp_dim, "', got ", spec_of(q).str());
    } else {
      TORCH_CHECK(p[i].is_replicate() || p[i].is_shard(2), "cp::context_attention: mesh dim ", i,
                  " must be Replicate or Shard(2) (heads), got ", spec_of(q).str());
    }
  }
  const at::Tensor out = context_attention(to_local(q), to_local(k), to_local(v), layout,
                                           mesh.get_group(dim), options);
  return from_local(out, mesh, std::vector<Placement>(p.begin(), p.end()));
}

}  // namespace dtensor::cp
