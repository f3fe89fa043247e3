#include "dtensor/core/api.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <sstream>

#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/core/redistribute.h"

namespace dtensor {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SpecHolder : torch::CustomClassHolder {
  SpecPtr spec;
  std::optional<Placements> grad_placements;
  RedistributeOptions options;
};

c10::IValue hold(SpecPtr spec, std::optional<Placements> grad = {}, RedistributeOptions o = {}) {
  auto h = c10::make_intrusive<SpecHolder>();
  h->spec = std::move(spec);
  h->grad_placements = std::move(grad);
  h->options = o;
  return c10::IValue::make_capsule(std::move(h));
}

const SpecHolder& held(AutogradContext* ctx) {
  return *static_cast<SpecHolder*>(ctx->saved_data.at("spec").toCapsule().get());
}

DeviceMesh mesh_or_current(const char* api) {
  auto m = current_mesh();
  TORCH_CHECK(m, api, ": No device mesh is currently active! Pass a mesh or use MeshGuard.");
  return *m;
}

Placements default_placements(const std::optional<std::vector<Placement>>& p,
                              const DeviceMesh& mesh) {
  if (p) return Placements(p->begin(), p->end());
  return Placements(static_cast<size_t>(mesh.ndim()), Replicate());
}

// A gradient that arrived as a plain global tensor: take our shard of it.
at::Tensor as_local_grad(const at::Tensor& grad, const DTensorSpec& target) {
  if (is_dtensor(grad)) return {};
  auto rep = make_spec(target.mesh(), replicate_all(target.mesh().ndim()), target.meta());
  return redistribute_local(grad, *rep,
                            *target.with_placements(backward_target(target.placements())))
      .wait();
}

// Moves a DTensor gradient to `target`'s placements (Partial targets stay Replicate) and
// returns its local tensor.
at::Tensor grad_to_local(const at::Tensor& grad, const DTensorSpec& target,
                         std::optional<c10::ScalarType> dtype = std::nullopt) {
  if (!grad.defined()) return grad;
  BackwardScope bw;
  if (!is_dtensor(grad)) return as_local_grad(grad, target);
  const auto* impl = dtensor_impl(grad);
  at::Tensor local = impl->local();
  const auto orig = local.scalar_type();
  if (dtype) local = local.to(*dtype);
  // The gradient's own metadata: its strides may differ from the forward input's (a
  // transposed gradient), and its local tensor follows them.
  auto dst = impl->spec()->with_placements(backward_target(target.placements()));
  at::Tensor out = redistribute_local(local, *impl->spec(), *dst, {.is_backward = true}).wait();
  return dtype ? out.to(orig) : out;
}

struct FromLocalFn : torch::autograd::Function<FromLocalFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& local, c10::IValue spec) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["spec"] = spec;
    auto s = static_cast<SpecHolder*>(spec.toCapsule().get())->spec;
    return {make_dtensor(local.tensor_data(), s)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grad_to_local(grads[0], *held(ctx).spec), at::Tensor()};
  }
};

struct ToLocalFn : torch::autograd::Function<ToLocalFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& dt, c10::IValue spec) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["spec"] = spec;
    // A fresh tensor on the local's memory and version counter for autograd to own, made
    // without an op (view_as or detach would be one more op per call on the step's stream).
    return {dtensor_impl(dt)->local().tensor_data()};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {g, at::Tensor()};
    const auto& h = held(ctx);
    const DTensorSpec& fwd = *h.spec;
    const Placements& p = h.grad_placements ? *h.grad_placements : fwd.placements();
    // Global stride recomputed from the gradient's local layout; global shape as in forward.
    auto gs = compute_global_shape_and_stride(g.sizes(), g.strides(), fwd.mesh().shape(), p);
    TensorMeta meta{fwd.shape(), gs.second, g.scalar_type()};
    if (!fwd.mesh().contains_this_rank() || gs.first != fwd.shape()) {
      meta.stride = default_strides(fwd.shape());
    }
    return {make_dtensor(g, make_spec(fwd.mesh(), p, meta)), at::Tensor()};
  }
};

// The forward of a redistribution, shared by the autograd Function and the no-grad path.
at::Tensor redistribute_forward(const at::Tensor& dt, const SpecPtr& dst,
                                const RedistributeOptions& o) {
  const auto* impl = dtensor_impl(dt);
  at::Tensor local = impl->local();
  const auto orig = local.scalar_type();
  if (o.forward_dtype) local = local.to(*o.forward_dtype);
  if (*dst == *impl->spec() && !o.forward_dtype) {
    return make_dtensor(local, dst);  // same layout: share the local tensor, no comm
  }
  auto pending = redistribute_local(local, *impl->spec(), *dst, {.async_op = o.async_op});
  if (o.forward_dtype) {
    pending.then([orig](at::Tensor x) { return x.to(orig); });
  }
  if (pending.ready()) return make_dtensor(pending.wait(), dst);
  at::Tensor out = make_dtensor(at::empty({0}, local.options().dtype(orig)), dst);
  dtensor_impl(out)->set_pending(std::move(pending));
  return out;
}

struct RedistributeFn : torch::autograd::Function<RedistributeFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& dt, c10::IValue dst_in) {
    ctx->set_materialize_grads(false);
    const auto& h = *static_cast<SpecHolder*>(dst_in.toCapsule().get());
    ctx->saved_data["spec"] = hold(dtensor_impl(dt)->spec(), {}, h.options);
    return {redistribute_forward(dt, h.spec, h.options)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& h = held(ctx);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {g, at::Tensor()};
    at::Tensor local = grad_to_local(g, *h.spec, h.options.backward_dtype);
    auto spec = h.spec->with_placements(backward_target(h.spec->placements()));
    // As in PyTorch, the gradient keeps the global strides it arrived with (grad_to_local laid
    // its shard out in their order), not the forward input's.
    TensorMeta meta = is_dtensor(g) ? dtensor_impl(g)->spec()->meta() : spec->meta();
    meta.dtype = local.scalar_type();
    return {make_dtensor(local, make_spec(spec->mesh(), spec->placements(), meta)), at::Tensor()};
  }
};

// Coordinate of the rank at row-major position `index` of `mesh`.
std::vector<int64_t> coordinate_of(const DeviceMesh& mesh, int64_t index) {
  std::vector<int64_t> c(mesh.ndim());
  for (int64_t i = mesh.ndim() - 1; i >= 0; --i) {
    c[i] = index % mesh.size(i);
    index /= mesh.size(i);
  }
  return c;
}

// from_local(run_check=true): every rank of the mesh must agree on dtype, requires_grad and
// ndim, and its local shape must be the one the global layout gives it (with a declared global
// shape: torch.chunk of it; without: every rank the same, as the even-shard default assumes).
// Every rank sees all ranks' metadata, so all fail together with the same message.
void check_from_local_consistency(const at::Tensor& local, const DeviceMesh& mesh,
                                  c10::ArrayRef<Placement> placements, const TensorMeta& meta,
                                  bool shape_given) {
  auto& world = *comm::world_group();
  auto head = comm::all_gather_into_tensor(
      at::tensor(std::vector<int64_t>{static_cast<int64_t>(local.scalar_type()),
                                      local.requires_grad() ? 1 : 0, local.dim()},
                 at::kLong)
          .unsqueeze(0),
      0, world);
  const auto& ranks = mesh.ranks();
  const int64_t r0 = ranks[0];
  std::ostringstream bad;
  auto note = [&bad](auto&&... parts) {
    if (bad.tellp() > 0) bad << "; ";
    ((bad << parts), ...);
  };
  auto h = [&](int64_t r, int64_t j) { return head[r][j].item<int64_t>(); };
  for (int64_t r : ranks) {
    if (h(r, 0) != h(r0, 0)) {
      note("rank ", r, " has dtype ", static_cast<at::ScalarType>(h(r, 0)), ", rank ", r0, " has ",
           static_cast<at::ScalarType>(h(r0, 0)));
    }
    if (h(r, 1) != h(r0, 1)) {
      note("rank ", r, " has requires_grad=", h(r, 1) != 0, ", rank ", r0, " has ", h(r0, 1) != 0);
    }
    if (h(r, 2) != h(r0, 2)) {
      note("rank ", r, " has a ", h(r, 2), "-D local tensor, rank ", r0, " a ", h(r0, 2), "-D one");
    }
  }
  if (bad.tellp() == 0) {
    // ndim agrees: gather every rank's local shape and stride.
    std::vector<int64_t> info(local.sizes().begin(), local.sizes().end());
    info.insert(info.end(), local.strides().begin(), local.strides().end());
    auto all = comm::all_gather_into_tensor(at::tensor(info, at::kLong).unsqueeze(0), 0, world);
    const int64_t nd = local.dim();
    auto shape_of = [&](int64_t r) {
      auto v = all[r].narrow(0, 0, nd).contiguous();
      return std::vector<int64_t>(v.data_ptr<int64_t>(), v.data_ptr<int64_t>() + nd);
    };
    auto stride_of = [&](int64_t r) {
      auto v = all[r].narrow(0, nd, nd).contiguous();
      return std::vector<int64_t>(v.data_ptr<int64_t>(), v.data_ptr<int64_t>() + nd);
    };
    if (shape_given && nd != static_cast<int64_t>(meta.shape.size())) {
      note("the local tensors are ", nd, "-D but the global shape ", c10::IntArrayRef(meta.shape),
           " has ", meta.shape.size(), " dims");
    } else if (shape_given) {
      for (size_t idx = 0; idx < ranks.size(); ++idx) {
        const auto want = compute_local_shape_and_global_offset(
                              meta.shape, mesh.shape(),
                              coordinate_of(mesh, static_cast<int64_t>(idx)), placements)
                              .shape;
        const auto have = shape_of(ranks[idx]);
        if (have != want) {
          note("rank ", ranks[idx], " has local shape ", c10::IntArrayRef(have), ", expected ",
               c10::IntArrayRef(want), " for global shape ", c10::IntArrayRef(meta.shape),
               " with placements ", to_string(placements));
        }
      }
    } else {
      for (int64_t r : ranks) {
        if (shape_of(r) != shape_of(r0) || stride_of(r) != stride_of(r0)) {
          note("rank ", r, " has local shape ", c10::IntArrayRef(shape_of(r)), " stride ",
               c10::IntArrayRef(stride_of(r)), ", rank ", r0, " has ",
               c10::IntArrayRef(shape_of(r0)), " stride ", c10::IntArrayRef(stride_of(r0)),
               " (without shape and stride, from_local assumes even shards; pass the global "
               "shape and stride for uneven ones)");
        }
      }
    }
  }
  TORCH_CHECK_VALUE(bad.tellp() == 0,
                    "Inconsistent tensor metadata (including shape and stride) across ranks "
                    "in from_local(run_check=true): ",
                    bad.str());
}

}  // namespace

at::Tensor from_local(const at::Tensor& local_in, const DeviceMesh& mesh,
                      c10::ArrayRef<Placement> placements_in, const FromLocalOptions& options) {
  TORCH_CHECK(!is_dtensor(local_in), "from_local: the input is already a DTensor");
  TORCH_CHECK(options.shape.has_value() == options.stride.has_value(),
              "Please pass both shape and stride at the same time.");
  at::Tensor local = local_in;
  if (local.device() != mesh.device() && mesh.contains_this_rank() &&
      local.device().type() != c10::DeviceType::Meta) {
    local = local.to(mesh.device());
  }
  Placements placements = normalize_placements(placements_in, local.dim(), mesh, "from_local");
  TensorMeta meta;
  meta.dtype = local.scalar_type();
  if (options.shape) {
    meta.shape = *options.shape;
    meta.stride = *options.stride;
  } else {
    auto gs =
        compute_global_shape_and_stride(local.sizes(), local.strides(), mesh.shape(), placements);
    meta.shape = std::move(gs.first);
    meta.stride = std::move(gs.second);
  }
  if (!mesh.contains_this_rank()) {
    local = at::empty({0}, local.options());
  } else if (options.run_check) {
    check_from_local_consistency(local, mesh, placements, meta, options.shape.has_value());
    for (int64_t i = 0; i < mesh.ndim(); ++i) {
      if (placements[i].is_replicate()) {
        at::Tensor b = comm::broadcast(local.detach(), 0, mesh.group(i));
        // rank 0's values, with an identity gradient to the caller's tensor (not mutated)
        local = local.requires_grad() ? b + (local - local.detach()) : b;
      }
    }
  }
  auto spec = make_spec(mesh, placements, std::move(meta));
  if (!c10::GradMode::is_enabled() || !local.requires_grad()) {
    // local without its autograd history (detach's result, made without an op)
    return make_dtensor(local.tensor_data(), std::move(spec));
  }
  return FromLocalFn::apply(local, hold(std::move(spec)))[0];
}

at::Tensor from_local(const at::Tensor& local, std::optional<std::vector<Placement>> placements,
                      const FromLocalOptions& options) {
  DeviceMesh mesh = mesh_or_current("from_local");
  return from_local(local, mesh, default_placements(placements, mesh), options);
}

at::Tensor to_local(const at::Tensor& dt, std::optional<std::vector<Placement>> grad_placements) {
  TORCH_CHECK(is_dtensor(dt), "to_local: expected a DTensor, got a plain tensor");
  const auto* impl = dtensor_impl(dt);
  if (!c10::GradMode::is_enabled()) return impl->local();
  std::optional<Placements> gp;
  if (grad_placements) {
    gp = normalize_placements(*grad_placements, dt.dim(), impl->spec()->mesh(),
                              "to_local(grad_placements)");
  }
  return ToLocalFn::apply(dt, hold(impl->spec(), gp))[0];
}

at::Tensor redistribute(const at::Tensor& dt, const DeviceMesh& mesh,
                        c10::ArrayRef<Placement> placements_in,
                        const RedistributeOptions& options) {
  TORCH_CHECK(is_dtensor(dt), "redistribute: expected a DTensor, got a plain tensor");
  const auto& src = *dtensor_impl(dt)->spec();
  TORCH_CHECK_NOT_IMPLEMENTED(mesh == src.mesh(), "Cross device mesh comm not supported yet! (",
                              src.mesh(), " -> ", mesh, ")");
  TORCH_CHECK(!placements_in.empty() || mesh.ndim() == 0, "placements is needed for redistribute!");
  Placements placements = normalize_placements(placements_in, dt.dim(), mesh, "redistribute");
  for (const auto& p : placements) {
    TORCH_CHECK(!p.is_partial(),
                "Can not redistribute to Partial, redistributing to Partial is for internal use "
                "only! (asked for ",
                to_string(placements), ")");
  }
  auto dst = src.with_placements(placements);
  if (!c10::GradMode::is_enabled() || !dt.requires_grad()) {
    return redistribute_forward(dt, dst, options);  // no graph to record: skip the autograd node
  }
  return RedistributeFn::apply(dt, hold(dst, {}, options))[0];
}

at::Tensor redistribute(const at::Tensor& dt, c10::ArrayRef<Placement> placements,
                        const RedistributeOptions& options) {
  TORCH_CHECK(is_dtensor(dt), "redistribute: expected a DTensor, got a plain tensor");
  return redistribute(dt, dtensor_impl(dt)->spec()->mesh(), placements, options);
}

at::Tensor full_tensor(const at::Tensor& dt,
                       std::optional<std::vector<Placement>> grad_placements) {
  TORCH_CHECK(is_dtensor(dt), "full_tensor: expected a DTensor, got a plain tensor");
  const auto& mesh = dtensor_impl(dt)->spec()->mesh();
  at::Tensor r = redistribute(dt, mesh, replicate_all(mesh.ndim()));
  return to_local(r, std::move(grad_placements));
}

at::Tensor distribute_tensor(const at::Tensor& tensor, const DeviceMesh& mesh,
                             c10::ArrayRef<Placement> placements_in,
                             std::optional<int64_t> src_data_rank) {
  TORCH_CHECK(tensor.is_leaf(),
              "`distribute_tensor` should be used to distribute leaf tensors! but found non-leaf "
              "tensor!");
  Placements placements =
      normalize_placements(placements_in, tensor.dim(), mesh, "distribute_tensor");
  if (is_dtensor(tensor)) {
    const auto& s = *dtensor_impl(tensor)->spec();
    TORCH_CHECK_VALUE(s.mesh() == mesh, "Cannot distribute a DTensor with device mesh ", s.mesh(),
                      " to a different device mesh ", mesh, ".");
    TORCH_CHECK_VALUE(std::equal(s.placements().begin(), s.placements().end(), placements.begin(),
                                 placements.end()),
                      "Cannot distribute a DTensor with placements ", to_string(s.placements()),
                      " to a different placements ", to_string(placements),
                      ". do you want to call `redistribute` instead?");
    return tensor;
  }
  for (const auto& p : placements) {
    TORCH_CHECK(!p.is_partial(), "Trying to distribute tensor with unsupported placements ",
                p.repr(), " on device mesh dimension; Partial cannot be distributed");
  }
  at::Tensor t = tensor.detach();
  if (t.device() != mesh.device() && t.device().type() != c10::DeviceType::Meta) {
    t = t.to(mesh.device());
  }
  TensorMeta meta{t.sizes().vec(), default_strides(t.sizes()), t.scalar_type()};
  if (!mesh.contains_this_rank()) {
    at::Tensor out = make_dtensor(at::empty({0}, t.options()), make_spec(mesh, placements, meta));
    out.set_requires_grad(tensor.requires_grad());
    return out;
  }
  const bool comm = src_data_rank.has_value() && t.device().type() != c10::DeviceType::Meta;
  const auto& coord = *mesh.coordinate();
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    comm::ProcessGroup& pg = mesh.group(i);
    const int64_t k = mesh.size(i);
    if (comm) {
      TORCH_CHECK(*src_data_rank >= 0 && *src_data_rank < k, "distribute_tensor: src_data_rank ",
                  *src_data_rank, " is outside mesh dim ", i, " of size ", k);
    }
    const Placement& p = placements[i];
    if (p.is_shard()) {
      const int64_t d = p.dim();
      const int64_t n = t.size(d);
      if (!comm) {
        t = local_chunk(t, d, k, coord[i]);
        continue;
      }
      // Scatter padded chunks from the source, unpad on receipt.
      const int64_t c = full_chunk_size(n, k);
      std::vector<int64_t> shape = t.sizes().vec();
      shape[d] = c;
      std::vector<at::Tensor> chunks;
      if (pg.rank() == *src_data_rank) {
        for (int64_t r = 0; r < k; ++r) {
          const ShardRange rg = chunk_range(n, k, r);
          at::Tensor piece = t.narrow(d, rg.size == 0 ? n : rg.offset, rg.size);
          at::Tensor padded = at::zeros(shape, t.options());
          padded.narrow(d, 0, rg.size).copy_(piece);
          chunks.push_back(padded);
        }
      }
      at::Tensor got = comm::scatter(chunks, at::empty(shape, t.options()),
                                     static_cast<int>(*src_data_rank), pg);
      t = got.narrow(d, 0, chunk_range(n, k, coord[i]).size).contiguous();
    } else if (comm) {
      t = comm::broadcast(t.contiguous(), static_cast<int>(*src_data_rank), pg);
    }
  }
  if (t.data_ptr() == tensor.data_ptr()) t = t.clone();  // never alias the caller's tensor
  at::Tensor out = make_dtensor(t, make_spec(mesh, placements, meta));
  out.set_requires_grad(tensor.requires_grad());
  return out;
}

at::Tensor distribute_tensor(const at::Tensor& tensor,
                             std::optional<std::vector<Placement>> placements,
                             std::optional<int64_t> src_data_rank) {
  DeviceMesh mesh = mesh_or_current("distribute_tensor");
  return distribute_tensor(tensor, mesh, default_placements(placements, mesh), src_data_rank);
}

}  // namespace dtensor
