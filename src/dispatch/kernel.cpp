// The boxed kernel every op on a DTensor reaches (docs/ARCHITECTURE.md, "The dispatch path"):
// unwrap -> cached sharding decision -> redistribute inputs -> local op -> wrap outputs.
#include "kernel.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/InferenceMode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <unordered_map>

#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/core/redistribute.h"
#include "dtensor/core/shard_math.h"
#include "dtensor/dispatch/explicit_redistribution.h"
#include "dtensor/dispatch/implicit_replication.h"
#include "leaf_gradient.h"
#include "op_registry.h"

namespace dtensor {
namespace {
thread_local bool tl_implicit_replication = false;
thread_local bool tl_explicit_redistribution = false;
}  // namespace
ImplicitReplication::ImplicitReplication() { tl_implicit_replication = true; }
ImplicitReplication::~ImplicitReplication() { tl_implicit_replication = false; }
bool ImplicitReplication::enabled() { return tl_implicit_replication; }

ExplicitRedistribution::ExplicitRedistribution() : prev_(tl_explicit_redistribution) {
  tl_explicit_redistribution = true;
}
ExplicitRedistribution::~ExplicitRedistribution() { tl_explicit_redistribution = prev_; }
bool ExplicitRedistribution::enabled() { return tl_explicit_redistribution; }
}  // namespace dtensor

namespace dtensor::dispatch {
namespace {
thread_local int64_t tl_decision_context = 0;
}  // namespace

int64_t decision_context() { return tl_decision_context; }
DecisionContextGuard::DecisionContextGuard(int64_t mask) : prev_(tl_decision_context) {
  tl_decision_context |= mask;
}
DecisionContextGuard::~DecisionContextGuard() { tl_decision_context = prev_; }

namespace {

// A tensor found among the arguments.
struct Slot {
  int arg;
  int list_index;     // -1 for a plain Tensor argument
  at::Tensor t;       // the DTensor or plain tensor as passed
  DTensorImpl* impl;  // null for plain tensors
};

struct CompiledReturn {
  ReturnKind kind;
  SpecPtr spec;                // Tensor return
  std::vector<SpecPtr> specs;  // Tensor[] return
  int writes_arg;
  bool respec = false;  // in-place op that changes its tensor's metadata (squeeze_, t_)
  // Fresh dense results: the local strides that follow the global stride order, checked
  // after the local call (empty: not checked).
  std::vector<int64_t> local_stride;
};

// A cached decision, ready to execute.
struct Compiled {
  std::vector<SpecPtr> in_spec;    // per slot: the spec it arrives with
  std::vector<SpecPtr> in_target;  // per slot: target spec, or null when unchanged
  std::vector<std::pair<int, c10::IValue>> local_args;
  std::vector<CompiledReturn> returns;
  bool mesh_member = true;
  bool communicates = false;  // some input's redistribution issues a collective
  LocalKernel local_kernel;
  std::vector<SpecPtr> local_in_specs;   // for local_kernel: specs at the local call
  std::vector<SpecPtr> local_out_specs;  // for local_kernel: per return
};

struct Key {
  const void* op;
  c10::SmallVector<int64_t, 24> words;
  c10::SmallVector<SpecPtr, 4> specs;
  size_t hash;
  bool operator==(const Key& o) const {
    if (hash != o.hash || op != o.op || words != o.words || specs.size() != o.specs.size()) {
      return false;
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      if (specs[i] != o.specs[i] && !(*specs[i] == *o.specs[i])) return false;
    }
    return true;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const { return k.hash; }
};

using Cache = std::unordered_map<Key, Compiled, KeyHash>;
Cache& cache() {
  thread_local Cache c;
  return c;
}
thread_local CacheStats tl_stats;

inline void mix(size_t& h, uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); }

void push_word(Key& k, int64_t w) {
  k.words.push_back(w);
  mix(k.hash, static_cast<uint64_t>(w));
}

// Plain non-scalar tensors join as Replicate under ImplicitReplication, and inside backward,
// where derivative formulas build global-size plain zeros (at::zeros(sizes, grad.options())).
bool plain_tensors_replicate() {
  return ImplicitReplication::enabled() || torch::autograd::get_current_graph_task_id() != -1;
}

void add_plain_to_key(Key& k, const at::Tensor& t) {
  push_word(k, -2);
  push_word(k, static_cast<int64_t>(t.scalar_type()));
  push_word(k, t.dim());
  for (auto s : t.sizes()) push_word(k, s);
  if (t.dim() > 0 && t.numel() != 1) push_word(k, plain_tensors_replicate() ? 1 : 0);
}

void add_tensor(Key& k, c10::SmallVector<Slot, 8>& slots, const at::Tensor& t, int arg, int li) {
  if (!t.defined()) {
    push_word(k, -3);
    return;
  }
  if (is_dtensor(t)) {
    auto* impl = dtensor_impl(t);
    if (C10_UNLIKELY(impl->requires_grad())) watch_leaf_gradient(t);
    slots.push_back(Slot{arg, li, t, impl});
    push_word(k, -1);
    k.specs.push_back(impl->spec());
    mix(k.hash, impl->spec()->hash());
  } else {
    slots.push_back(Slot{arg, li, t, nullptr});
    add_plain_to_key(k, t);
  }
}

// Collects tensor slots and builds the cache key from the op and its arguments.
void scan(const OpInfo& info, const void* op_key, c10::ArrayRef<c10::IValue> args, Key& k,
          c10::SmallVector<Slot, 8>& slots) {
  k.op = op_key;
  k.hash = reinterpret_cast<size_t>(op_key);
  if (C10_UNLIKELY(tl_decision_context != 0)) push_word(k, tl_decision_context);
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = args[i];
    const int ai = static_cast<int>(i);
    if (v.isTensor()) {
      add_tensor(k, slots, v.toTensor(), ai, -1);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      push_word(k, -4);
      push_word(k, static_cast<int64_t>(list.size()));
      for (size_t j = 0; j < list.size(); ++j)
        add_tensor(k, slots, list.get(j), ai, static_cast<int>(j));
    } else if (v.isList()) {
      auto list = v.toListRef();
      push_word(k, -5);
      push_word(k, static_cast<int64_t>(list.size()));
      for (size_t j = 0; j < list.size(); ++j) {
        const auto& e = list[j];
        if (e.isTensor()) {
          add_tensor(k, slots, e.toTensor(), ai, static_cast<int>(j));
        } else if (e.isInt()) {
          if (info.static_arg[i]) push_word(k, e.toInt());
        } else if (e.isBool()) {
          if (info.static_arg[i]) push_word(k, e.toBool());
        } else if (e.isNone()) {
          push_word(k, -6);
        }
      }
    } else if (!info.static_arg[i]) {
      // Scalars/floats: only their kind matters (int vs float changes the result dtype).
      push_word(k, v.isDouble() ? -10
                   : v.isInt()  ? -11
                   : v.isBool() ? -12
                   : v.isNone() ? -13
                                : -14);
    } else if (v.isInt()) {
      push_word(k, v.toInt());
    } else if (v.isDouble()) {
      const double x = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &x, sizeof(bits));
      push_word(k, bits);
    } else if (v.isBool()) {
      push_word(k, v.toBool() ? 1 : 0);
    } else if (v.isIntList()) {
      auto l = v.toIntList();
      push_word(k, -7);
      push_word(k, static_cast<int64_t>(l.size()));
      for (int64_t x : l) push_word(k, x);
    } else if (v.isNone()) {
      push_word(k, -8);
    } else if (v.isString()) {
      push_word(k, static_cast<int64_t>(std::hash<std::string>{}(v.toStringRef())));
    } else if (v.isDevice()) {
      push_word(k, static_cast<int64_t>(v.toDevice().type()));
    }
  }
}

[[noreturn]] void fail_mixed(const OpInfo& info) {
  TORCH_CHECK(false, info.name,
              ": got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor "
              "before calling distributed operators! (or wrap the call in "
              "dtensor::ImplicitReplication to treat plain tensors as replicated)");
}

// Global metadata of the outputs: run the op on meta tensors with global shapes.
std::vector<std::optional<TensorMeta>> meta_outputs(const c10::OperatorHandle& op,
                                                    const OpInfo& info,
                                                    c10::ArrayRef<c10::IValue> args,
                                                    const c10::SmallVector<Slot, 8>& slots,
                                                    const std::vector<SpecPtr>& specs,
                                                    std::vector<std::vector<TensorMeta>>& lists) {
  torch::jit::Stack st(args.begin(), args.end());
  auto meta_of = [&](size_t s) {
    const auto& sp = *specs[s];
    return at::empty_strided(sp.shape(), sp.stride(),
                             at::TensorOptions().dtype(sp.dtype()).device(c10::kMeta));
  };
  // Tensor lists are rebuilt whole.
  std::unordered_map<int, std::vector<std::pair<int, size_t>>> list_slots;
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s].list_index < 0) {
      st[slots[s].arg] = meta_of(s);
    } else {
      list_slots[slots[s].arg].push_back({slots[s].list_index, s});
    }
  }
  for (auto& [arg, entries] : list_slots) {
    const c10::IValue& orig = args[arg];
    if (orig.isTensorList()) {
      auto l = orig.toTensorList().copy();
      for (auto [li, s] : entries) l.set(li, meta_of(s));
      st[arg] = l;
    } else {
      auto l = orig.toList().copy();
      for (auto [li, s] : entries) l.set(li, meta_of(s));
      st[arg] = l;
    }
  }
  for (auto& v : st) {
    if (v.isDevice()) v = c10::IValue(c10::Device(c10::kMeta));
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    // Shape inference, not work: profilers and FLOP counters (RecordFunction) do not see it.
    at::DisableRecordFunctionGuard not_work;
    op.callBoxed(st);
  }
  std::vector<std::optional<TensorMeta>> out(info.num_returns);
  lists.assign(info.num_returns, {});
  for (size_t r = 0; r < info.num_returns; ++r) {
    const auto& v = st[r];
    auto tm = [](const at::Tensor& t) {
      return TensorMeta{t.sizes().vec(), t.strides().vec(), t.scalar_type()};
    };
    if (info.return_kind[r] == ReturnKind::Tensor && v.isTensor()) {
      out[r] = tm(v.toTensor());
    } else if (info.return_kind[r] == ReturnKind::TensorList) {
      for (const auto& t : v.toTensorVector()) lists[r].push_back(tm(t));
    }
  }
  return out;
}

// Whether `t`'s strides agree with `expected` on every dim that has more than one element.
bool has_layout(const at::Tensor& t, const std::vector<int64_t>& expected) {
  if (t.numel() <= 1) return true;
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < expected.size(); ++d) {
    if (sizes[d] > 1 && strides[d] != expected[d]) return false;
  }
  return true;
}

// The op refused the inputs' global shapes: the same error on every rank, naming the layout.
[[noreturn]] void fail_global_shapes(const OpInfo& info, const OpCall& call, const c10::Error& e) {
  TORCH_CHECK_VALUE(false, "dtensor: ", info.name, " rejects the global shapes of its inputs ",
                    call.placements_str(), ": ", e.msg());
}

bool is_dense(const TensorMeta& m) {
  int64_t expected = 1;
  std::vector<int64_t> order(m.shape.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return m.stride[a] < m.stride[b]; });
  for (int64_t d : order) {
    if (m.shape[d] == 1) continue;
    if (m.stride[d] != expected) return false;
    expected *= m.shape[d];
  }
  return true;
}

// A rule that supplies its outputs' metadata still gets the op's own checks of the global
// shapes (broadcasting, contracted sizes, dims in range) by a run on meta tensors, once per
// cache entry; every rank then refuses the same inputs with the same message, instead of
// some ranks failing on their local shards and the others waiting in the next collective.
// Ops without a meta kernel rely on their rule's checks. Where the meta run succeeds, its
// strides (PyTorch's layout propagation) replace dense strides the rule guessed.
void check_global_shapes(const c10::OperatorHandle& op, const OpInfo& info, const OpCall& call,
                         c10::ArrayRef<c10::IValue> args, const c10::SmallVector<Slot, 8>& slots,
                         const std::vector<SpecPtr>& specs,
                         std::vector<std::optional<TensorMeta>>& metas) {
  for (size_t r = 0; r < info.num_returns; ++r) {
    // Data-dependent outputs (no metadata from the rule) cannot be found on meta tensors.
    if (info.return_kind[r] != ReturnKind::Other && (r >= metas.size() || !metas[r])) return;
  }
  std::vector<std::vector<TensorMeta>> lists;
  std::vector<std::optional<TensorMeta>> found;
  try {
    found = meta_outputs(op, info, args, slots, specs, lists);
  } catch (const c10::NotImplementedError&) {
    return;
  } catch (const c10::Error& e) {
    fail_global_shapes(info, call, e);
  }
  for (size_t r = 0; r < metas.size() && r < found.size(); ++r) {
    if (!metas[r] || !found[r]) continue;
    TORCH_CHECK(metas[r]->shape == found[r]->shape, "dtensor: the sharding rule of ", info.name,
                " gives output ", r, " the global shape ", c10::IntArrayRef(metas[r]->shape),
                " but the op gives ", c10::IntArrayRef(found[r]->shape), " for inputs ",
                call.placements_str());
    if (is_dense(*metas[r]) && is_dense(*found[r])) metas[r]->stride = found[r]->stride;
  }
}

// The compute mesh: the first DTensor's; all DTensors must share it.
const DeviceMesh& compute_mesh(const OpInfo& info, const c10::SmallVector<Slot, 8>& slots) {
  const DeviceMesh* mesh = nullptr;
  for (const auto& s : slots) {
    if (!s.impl) continue;
    const DeviceMesh& m = s.impl->spec()->mesh();
    if (!mesh) {
      mesh = &m;
    } else {
      TORCH_CHECK_VALUE(*mesh == m, info.name,
                        ": could not run computation across different "
                        "meshes (",
                        *mesh, " and ", m, ")");
    }
  }
  return *mesh;
}

// Each slot's spec as it arrives; plain tensors count as replicated where that is allowed.
std::vector<InputSpec> input_specs(const OpInfo& info, const c10::SmallVector<Slot, 8>& slots,
                                   const DeviceMesh& mesh, Compiled& c) {
  std::vector<InputSpec> inputs;
  for (const auto& s : slots) {
    SpecPtr sp;
    if (s.impl) {
      sp = s.impl->spec();
    } else {
      const at::Tensor& t = s.t;
      if (t.dim() > 0 && t.numel() != 1 && !plain_tensors_replicate()) fail_mixed(info);
      sp = make_spec(mesh, replicate_all(mesh.ndim()),
                     TensorMeta{t.sizes().vec(), t.strides().vec(), t.scalar_type()});
    }
    inputs.push_back(InputSpec{sp, s.arg, s.list_index});
    c.in_spec.push_back(sp);
  }
  return inputs;
}

// Runs the rule that applies (a context rule whose bit is set, else the op's) and checks the
// size of its answer.
Decision run_rule(const OpInfo& info, const OpCall& call, size_t num_slots) {
  const Rule* rule = info.rule;
  for (const ContextRule* cr : info.context_rules) {
    if (tl_decision_context & cr->mask) {
      rule = &cr->rule;
      break;
    }
  }
  if (!rule) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "Operator ", info.name,
                                " does not have a sharding strategy registered (inputs ",
                                call.placements_str(),
                                "). dtensor will not run it on local "
                                "shards silently: add a rule with dtensor::dispatch::register_rule,"
                                " or call full_tensor()/to_local() first.");
  }
  Decision d = (*rule)(call);
  TORCH_CHECK(d.inputs.size() == num_slots, "dtensor: the rule for ", info.name, " returned ",
              d.inputs.size(), " input placements for ", num_slots, " inputs");
  TORCH_CHECK(d.outputs.size() == info.num_returns, "dtensor: the rule for ", info.name,
              " returned ", d.outputs.size(), " output placements for ", info.num_returns,
              " returns");
  return d;
}

// Fills c.in_target (the specs inputs must be moved to) and c.communicates; returns each
// slot's spec at the local call.
std::vector<SpecPtr> plan_inputs(const Decision& d, Compiled& c) {
  std::vector<SpecPtr> target_specs;
  for (size_t i = 0; i < c.in_spec.size(); ++i) {
    const auto& cur = *c.in_spec[i];
    SpecPtr t;
    if (!d.inputs[i].empty() && !std::equal(d.inputs[i].begin(), d.inputs[i].end(),
                                            cur.placements().begin(), cur.placements().end())) {
      t = cur.with_placements(d.inputs[i]);
    }
    target_specs.push_back(t ? t : c.in_spec[i]);
    if (t) {
      // Moves out of Replicate are local chunks or zero-fills; anything else communicates.
      for (size_t m = 0; m < d.inputs[i].size(); ++m) {
        const Placement& from = cur.placements()[m];
        c.communicates = c.communicates || (!from.is_replicate() && !(from == d.inputs[i][m]));
      }
    }
    c.in_target.push_back(std::move(t));
  }
  return target_specs;
}

// Output metadata from the rule (checked against the op's own shape checks), or from the op
// on meta tensors; `list_meta` receives Tensor[] returns'.
std::vector<std::optional<TensorMeta>> output_metadata(
    const c10::OperatorHandle& op, const OpInfo& info, const OpCall& call,
    c10::ArrayRef<c10::IValue> args, const c10::SmallVector<Slot, 8>& slots, const Decision& d,
    const Compiled& c, std::vector<std::vector<TensorMeta>>& list_meta) {
  std::vector<std::optional<TensorMeta>> metas;
  if (!d.output_meta.empty()) {
    metas = d.output_meta;
    check_global_shapes(op, info, call, args, slots, c.in_spec, metas);
    return metas;
  }
  try {
    metas = meta_outputs(op, info, args, slots, c.in_spec, list_meta);
  } catch (const c10::NotImplementedError& e) {
    TORCH_CHECK(false, "dtensor: ", info.name,
                " cannot run on meta tensors to find its output "
                "shapes, and its sharding rule does not supply them: ",
                e.what_without_backtrace());
  } catch (const c10::Error& e) {
    fail_global_shapes(info, call, e);
  }
  return metas;
}

// In-place / out=: the written tensor cannot be moved to another layout first; ops that
// restride it (squeeze_, t_) give it the rule's new spec after the call.
void check_written_input(const OpInfo& info, const c10::SmallVector<Slot, 8>& slots,
                         const Compiled& c, const std::vector<SpecPtr>& target_specs,
                         CompiledReturn& cr) {
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].arg != cr.writes_arg || slots[i].list_index >= 0) continue;
    TORCH_CHECK(!c.in_target[i], info.name, " is in-place on a DTensor with placements ",
                to_string(c.in_spec[i]->placements()), " but its sharding needs ",
                to_string(target_specs[i]->placements()),
                "; use the out-of-place op or redistribute first");
    if (cr.spec && !(*cr.spec == *c.in_spec[i])) {
      TORCH_CHECK(cr.spec->placements() == c.in_spec[i]->placements() ||
                      cr.spec->shape() != c.in_spec[i]->shape() ||
                      cr.spec->stride() != c.in_spec[i]->stride(),
                  info.name, " is in-place on a DTensor with placements ",
                  to_string(c.in_spec[i]->placements()), " but its result would be ",
                  to_string(cr.spec->placements()),
                  "; use the out-of-place op or redistribute first");
      cr.respec = true;
    } else {
      cr.spec = c.in_spec[i];
    }
  }
}

// Return r's spec(s) from the rule's placements and the metadata.
CompiledReturn compile_return(size_t r, const OpInfo& info, const DeviceMesh& mesh,
                              const Decision& d,
                              const std::vector<std::optional<TensorMeta>>& metas,
                              const std::vector<std::vector<TensorMeta>>& list_meta) {
  CompiledReturn cr{info.return_kind[r], nullptr, {}, info.return_writes_arg[r]};
  if (cr.kind == ReturnKind::Tensor && d.outputs[r]) {
    TORCH_CHECK(metas.size() > r && metas[r], "dtensor: no metadata for output ", r, " of ",
                info.name);
    cr.spec = make_spec(mesh, *d.outputs[r], *metas[r]);
  } else if (cr.kind == ReturnKind::TensorList && d.outputs[r]) {
    for (const auto& m : list_meta[r]) cr.specs.push_back(make_spec(mesh, *d.outputs[r], m));
  }
  return cr;
}

// Fresh dense results: the local strides that follow the global stride order.
void set_local_stride(size_t r, const OpInfo& info, const DeviceMesh& mesh, CompiledReturn& cr) {
  if (cr.kind == ReturnKind::Tensor && cr.spec && cr.writes_arg < 0 && !info.return_is_view[r] &&
      is_dense(cr.spec->meta()) && mesh.coordinate()) {
    const auto local =
        compute_local_shape_and_global_offset(cr.spec->shape(), mesh.shape(), *mesh.coordinate(),
                                              cr.spec->placements())
            .shape;
    cr.local_stride = strides_like(local, cr.spec->stride());
  }
}

Compiled compile(const c10::OperatorHandle& op, const OpInfo& info, c10::ArrayRef<c10::IValue> args,
                 const c10::SmallVector<Slot, 8>& slots) {
  const DeviceMesh& mesh = compute_mesh(info, slots);
  Compiled c;
  c.in_target.reserve(slots.size());
  const std::vector<InputSpec> inputs = input_specs(info, slots, mesh, c);
  OpCall call(op, args, inputs, mesh);
  Decision d = run_rule(info, call, slots.size());
  const std::vector<SpecPtr> target_specs = plan_inputs(d, c);
  std::vector<std::vector<TensorMeta>> list_meta;
  const auto metas = output_metadata(op, info, call, args, slots, d, c, list_meta);
  for (size_t r = 0; r < info.num_returns; ++r) {
    CompiledReturn cr = compile_return(r, info, mesh, d, metas, list_meta);
    if (cr.writes_arg >= 0) check_written_input(info, slots, c, target_specs, cr);
    set_local_stride(r, info, mesh, cr);
    c.returns.push_back(std::move(cr));
  }
  c.local_args = std::move(d.local_args);
  c.mesh_member = mesh.contains_this_rank();
  if (d.local_kernel) {
    c.local_kernel = std::move(d.local_kernel);
    c.local_in_specs = target_specs;
    for (const auto& r : c.returns) c.local_out_specs.push_back(r.spec);
  }
  return c;
}

// Local value a rank outside the mesh returns for a non-tensor output.
c10::IValue non_member_value(const c10::Argument& ret) {
  switch (ret.type()->kind()) {
    case c10::TypeKind::BoolType:
      return true;
    case c10::TypeKind::IntType:
      return int64_t{0};
    case c10::TypeKind::FloatType:
      return 0.0;
    default:
      return c10::IValue(at::Scalar(0));
  }
}

void set_local(torch::jit::Stack& stack, size_t base, const Slot& s, const at::Tensor& local) {
  c10::IValue& slot = stack[base + s.arg];
  if (s.list_index < 0) {
    slot = local;
  } else if (slot.isTensorList()) {
    auto l = slot.toTensorList();
    l.set(s.list_index, local);
  } else {
    auto l = slot.toList();
    l.set(s.list_index, local);
  }
}

// "(S(0))[8, 4], (R)[4]" for error messages.
std::string describe(const std::vector<SpecPtr>& specs) {
  std::ostringstream os;
  for (size_t i = 0; i < specs.size(); ++i) {
    os << (i ? ", " : "") << to_string(specs[i]->placements())
       << c10::IntArrayRef(specs[i]->shape());
  }
  return os.str();
}

[[noreturn]] void fail_implicit_redistribution(const OpInfo& info, const Compiled& cd) {
  std::ostringstream moves;
  for (size_t i = 0; i < cd.in_target.size(); ++i) {
    if (!cd.in_target[i]) continue;
    moves << "\n  input " << i << " " << c10::IntArrayRef(cd.in_spec[i]->shape()) << ": "
          << to_string(cd.in_spec[i]->placements()) << " -> "
          << to_string(cd.in_target[i]->placements());
  }
  const std::string module = ModuleScope::current();
  TORCH_CHECK(false, info.name, " needs an implicit redistribution in ",
              module.empty() ? std::string("no tracked module") : "module '" + module + "'",
              BackwardScope::active() || torch::autograd::get_current_graph_task_id() != -1
                  ? " (backward)"
                  : " (forward)",
              ", which ExplicitRedistribution forbids:", moves.str(),
              "\nRedistribute the inputs yourself (redistribute()), or change the plan.");
}

void run_local(const c10::OperatorHandle& op, const Compiled& cd,
               const c10::SmallVector<Slot, 8>& slots, torch::jit::Stack& st, size_t base);
void wrap_returns(const Compiled& cd, c10::SmallVector<at::Tensor, 2>& written,
                  torch::jit::Stack& st);

void run(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const OpInfo& info = op_info(op);
  const size_t nargs = info.num_args;
  const size_t base = stack->size() - nargs;
  auto args = c10::ArrayRef<c10::IValue>(stack->data() + base, nargs);

  Key key;
  c10::SmallVector<Slot, 8> slots;
  scan(info, &op.schema(), args, key, slots);

  auto& c = cache();
  auto it = c.find(key);
  if (it == c.end()) {
    ++tl_stats.misses;
    it = c.emplace(std::move(key), compile(op, info, args, slots)).first;
  } else {
    ++tl_stats.hits;
  }
  const Compiled& cd = it->second;

  // Keep the wrappers written in place to hand them back.
  c10::SmallVector<at::Tensor, 2> written;
  for (const auto& r : cd.returns) {
    if (r.writes_arg >= 0) written.push_back(args[r.writes_arg].toTensor());
  }

  if (!cd.mesh_member) {
    torch::jit::drop(*stack, nargs);
    size_t w = 0;
    for (size_t r = 0; r < cd.returns.size(); ++r) {
      const auto& cr = cd.returns[r];
      if (cr.writes_arg >= 0) {
        stack->push_back(written[w++]);
      } else if (cr.kind == ReturnKind::Tensor && cr.spec) {
        const bool scalar = cr.spec->ndim() == 0;
        auto opts = at::TensorOptions().dtype(cr.spec->dtype()).device(cr.spec->mesh().device());
        stack->push_back(
            make_dtensor(scalar ? at::zeros({}, opts) : at::empty({0}, opts), cr.spec));
      } else if (cr.kind == ReturnKind::TensorList) {
        std::vector<at::Tensor> v;
        for (const auto& sp : cr.specs) {
          v.push_back(make_dtensor(at::empty({0}, at::TensorOptions().dtype(sp->dtype())), sp));
        }
        stack->push_back(c10::IValue(v));
      } else {
        stack->push_back(non_member_value(op.schema().returns()[r]));
      }
    }
    return;
  }

  if (C10_UNLIKELY(tl_explicit_redistribution && cd.communicates)) {
    fail_implicit_redistribution(info, cd);
  }
  try {
    run_local(op, cd, slots, *stack, base);
  } catch (c10::Error& e) {
    e.add_context(c10::str("while running ", info.name, " on DTensor inputs ", describe(cd.in_spec),
                           " (module '", ModuleScope::current(), "')"));
    throw;
  }
  wrap_returns(cd, written, *stack);
}

void run_local(const c10::OperatorHandle& op, const Compiled& cd,
               const c10::SmallVector<Slot, 8>& slots, torch::jit::Stack& st, size_t base) {
  torch::jit::Stack* stack = &st;
  int copied_list = -1;
  for (size_t i = 0; i < slots.size(); ++i) {
    const Slot& s = slots[i];
    if (s.list_index >= 0 && s.arg != copied_list) {
      // Lists have reference semantics: never write locals into the caller's list.
      auto& v = (*stack)[base + s.arg];
      v = v.isTensorList() ? c10::IValue(v.toTensorList().copy()) : c10::IValue(v.toList().copy());
      copied_list = s.arg;
    }
    at::Tensor local = s.impl ? s.impl->local() : s.t;
    if (const auto& target = cd.in_target[i]) {
      local = redistribute_local(local, *cd.in_spec[i], *target).wait();
    }
    set_local(*stack, base, s, local);
  }
  for (const auto& [idx, v] : cd.local_args) (*stack)[base + idx] = v;

  {
    at::AutoDispatchBelowADInplaceOrView guard;
    if (C10_UNLIKELY(static_cast<bool>(cd.local_kernel))) {
      cd.local_kernel(op, *stack, LocalContext{cd.local_in_specs, cd.local_out_specs});
    } else {
      op.callBoxed(*stack);
    }
  }
}

void wrap_returns(const Compiled& cd, c10::SmallVector<at::Tensor, 2>& written,
                  torch::jit::Stack& st) {
  torch::jit::Stack* stack = &st;
  const size_t nret = cd.returns.size();
  const size_t rbase = stack->size() - nret;
  size_t w = 0;
  for (size_t r = 0; r < nret; ++r) {
    const auto& cr = cd.returns[r];
    c10::IValue& out = (*stack)[rbase + r];
    if (cr.writes_arg >= 0) {
      if (C10_UNLIKELY(cr.respec)) dtensor_impl(written[w])->replace(out.toTensor(), cr.spec);
      out = written[w++];
    } else if (cr.kind == ReturnKind::Tensor) {
      if (cr.spec && out.isTensor()) {
        // A DTensor's local tensor is laid out in its global stride order, so that views and
        // reshapes decided on the global strides are valid on every rank's shard.
        if (!cr.local_stride.empty() &&
            C10_UNLIKELY(!has_layout(out.toTensor(), cr.local_stride))) {
          const at::Tensor& t = out.toTensor();
          ++tl_stats.layout_copies;
          at::Tensor laid = at::empty_strided(t.sizes(), cr.local_stride, t.options());
          laid.copy_(t);
          out = laid;
        }
        out = make_dtensor(out.toTensor(), cr.spec);
      }
    } else if (cr.kind == ReturnKind::TensorList && !cr.specs.empty()) {
      auto locals = out.toTensorVector();
      std::vector<at::Tensor> wrapped;
      wrapped.reserve(locals.size());
      for (size_t j = 0; j < locals.size(); ++j)
        wrapped.push_back(make_dtensor(locals[j], cr.specs[j]));
      out = c10::IValue(wrapped);
    }
  }
}

// Whether `e` is LibTorch's refusal to hand out the memory of a tensor without storage.
bool reads_missing_storage(const c10::Error& e) {
  const std::string& m = e.msg();
  return m.find("Cannot access data pointer of Tensor that doesn't have storage") !=
             std::string::npos ||
         m.find("Cannot access storage of") != std::string::npos;
}

// "(S(0))[8, 4], (R)[4]": the placements and global shapes of the DTensors among `args`.
std::string describe_dtensors(c10::ArrayRef<c10::IValue> args) {
  std::vector<SpecPtr> specs;
  auto add = [&](const at::Tensor& t) {
    if (is_dtensor(t)) specs.push_back(dtensor_impl(t)->spec());
  };
  for (const auto& a : args) {
    if (a.isTensor()) {
      add(a.toTensor());
    } else if (a.isTensorList()) {
      for (const at::Tensor& t : a.toTensorList()) add(t);
    } else if (a.isList()) {
      for (const c10::IValue& v : a.toListRef()) {
        if (v.isTensor()) add(v.toTensor());
      }
    }
  }
  return describe(specs);
}

}  // namespace

void dtensor_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) { run(op, stack); }

void composite_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                      torch::jit::Stack* stack) {
  const OpInfo& info = op_info(op);
  if (C10_UNLIKELY(info.decomposition != nullptr)) {
    (*info.decomposition)(*stack);
    return;
  }
  // The arguments, kept to name them if the decomposition fails (the call consumes the stack).
  const size_t nargs = info.num_args;
  const c10::SmallVector<c10::IValue, 8> args(stack->end() - nargs, stack->end());
  try {
    op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
  } catch (const c10::Error& e) {
    if (!reads_missing_storage(e)) throw;
    TORCH_CHECK(false, "dtensor: ", info.name, " cannot run on DTensor inputs ",
                describe_dtensors(args),
                ": LibTorch implements it by decomposing it above the DTensor kernel, and the "
                "decomposition reads a DTensor's memory, which a DTensor does not have (its "
                "values are shards on the ranks). Run it on full_tensor() or to_local() "
                "values, or register a DTensor decomposition for it "
                "(dispatch::register_decomposition)");
  }
}

CacheStats cache_stats() {
  CacheStats s = tl_stats;
  s.entries = cache().size();
  return s;
}

void clear_cache() { cache().clear(); }

}  // namespace dtensor::dispatch
