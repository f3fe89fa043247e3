// fully_shard: see include/dtensor/fsdp/fully_shard.h.
#include "dtensor/fsdp/fully_shard.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "dtensor/comm/collective_tape.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/comm/process_group.h"
#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/core/shard_math.h"
#include "dtensor/tp/module_hooks.h"
#include "sync_units.h"

namespace dtensor::fsdp {
namespace {

// Every leaf fully_shard created, so a parent unit leaves its children's parameters alone. The
// weak reference keeps a dead shard's TensorImpl allocation (not its storage) until the entry is
// pruned, so a later tensor cannot take its address and pass for a shard.
struct ShardEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  ShardInfo info;  // rows, the dp group, the TP spec
};
std::mutex& shards_mu() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<const c10::TensorImpl*, ShardEntry>& shards() {
  static std::unordered_map<const c10::TensorImpl*, ShardEntry> m;
  return m;
}
// The live shard entry of `t`, or nullptr; call with shards_mu() held.
const ShardEntry* find_shard(const at::Tensor& t) {
  auto it = shards().find(t.unsafeGetTensorImpl());
  return it == shards().end() || it->second.impl.expired() ? nullptr : &it->second;
}
void prune_dead_shards() {
  std::lock_guard<std::mutex> l(shards_mu());
  for (auto it = shards().begin(); it != shards().end();)
    it = it->second.impl.expired() ? shards().erase(it) : std::next(it);
}

// One managed parameter: where it lives in the module tree and how its rows are split.
struct ParamSlot {
  torch::nn::Module* owner;
  std::string name;
  std::vector<int64_t> full_shape;
  int64_t chunk_rows;  // rows per rank in the padded layout (torch.chunk's chunk size)
  int64_t row_numel;   // elements per row
  int64_t offset;      // start of this parameter in a rank's flat segment
  // The leaf the optimizer steps: a DTensor sharded over dp (after tp's placements), whose
  // local tensor holds this rank's rows, unpadded.
  at::Tensor shard;
  // Set for a tensor-parallel DTensor parameter: FSDP shards its local tensor, and the gathered
  // local tensor is wrapped back into a DTensor with this spec for the module.
  std::shared_ptr<const DTensorSpec> tp_spec;
};

// This rank's rows of a parameter: the local tensor of its leaf (read each time: loading a
// checkpoint or `.data =` may give the leaf another one).
at::Tensor rows_of(const ParamSlot& p) { return local_tensor(p.shard); }

// Gradient synchronisation of a unit (set_requires_gradient_sync): while off, its backward
// sums the unsharded gradients into grad_acc instead of reduce-scattering them, and its
// all-gathered parameters are kept for the next forwards and regathers (valid while the shards
// keep the versions they had when gathered).
struct SyncState : detail::GradientSync {
  at::Tensor grad_acc;  // [dp, segment] in the reduce dtype, summed over the deferred backwards
  at::Tensor kept;      // [dp, segment]: the all-gathered shards
  std::vector<int64_t> kept_versions;
};

struct UnitState {
  std::string unit_name;
  std::shared_ptr<SyncState> sync = std::make_shared<SyncState>();
  std::shared_ptr<comm::ProcessGroup> pg;
  int64_t dp = 1;
  int64_t segment = 0;  // elements of one rank's flat buffer
  bool reshard_after_forward = false;
  bool prefetch = true;
  std::optional<at::ScalarType> param_dtype, reduce_dtype;
  std::vector<ParamSlot> params;

  at::ScalarType shard_dtype() const { return params[0].shard.scalar_type(); }
  at::TensorOptions shard_options() const { return rows_of(params[0]).options(); }
  at::ScalarType gather_dtype() const { return param_dtype.value_or(shard_dtype()); }
  // FSDP2's default: gradients are reduced in the dtype they arrive in (param_dtype).
  at::ScalarType grad_reduce_dtype() const { return reduce_dtype.value_or(gather_dtype()); }
};

// This rank's flat segment: every shard, in param_dtype, at its offset.
at::Tensor pack_shards(const UnitState& st) {
  at::Tensor flat = at::zeros({st.segment}, st.shard_options().dtype(st.gather_dtype()));
  for (const auto& p : st.params) {
    const at::Tensor rows = rows_of(p);
    flat.narrow(0, p.offset, rows.numel()).copy_(rows.reshape({-1}));
  }
  return flat;
}

// All ranks' shards of the unit: one all-gather of this rank's flat segment, as [dp, segment].
at::Tensor all_gather_shards(const UnitState& st) {
  return comm::all_gather_into_tensor(pack_shards(st), 0, *st.pg).view({st.dp, st.segment});
}

// The same all-gather started now and waited for later (a prefetch).
comm::PendingResult all_gather_shards_async(const UnitState& st) {
  return comm::all_gather_into_tensor_async(pack_shards(st), 0, *st.pg);
}

std::vector<int64_t> shard_versions(const UnitState& st) {
  std::vector<int64_t> v;
  for (const auto& p : st.params) v.push_back(static_cast<int64_t>(p.shard._version()));
  return v;
}

// Whether the unit holds gathered parameters from a deferred-sync forward that are still valid;
// call with st.sync->mu held.
bool kept_valid(const UnitState& st) {
  return st.sync->kept.defined() && st.sync->kept_versions == shard_versions(st);
}

// The unit's gathered parameters as [dp, segment]: the kept ones when valid, else `ready` (an
// all-gather already done), else a new all-gather. Kept for later calls while gradient sync is
// off (the calls that take views of it do not free them: GatheredCall::kept_storage).
at::Tensor gathered_shards(const UnitState& st, const at::Tensor& ready) {
  std::lock_guard<std::mutex> l(st.sync->mu);
  SyncState& s = *st.sync;
  if (kept_valid(st)) return s.kept;
  at::Tensor gathered = ready.defined() ? ready : all_gather_shards(st);
  if (s.requires_sync) {
    s.kept = at::Tensor();
    return gathered;
  }
  s.kept = gathered;
  s.kept_versions = shard_versions(st);
  return gathered;
}

// Whether a prefetch would gather what is kept anyway.
bool has_kept(const UnitState& st) {
  std::lock_guard<std::mutex> l(st.sync->mu);
  return kept_valid(st);
}

// A unit between calls: the unit whose forward came next last time, and the all-gather of this
// unit started ahead of its forward by the unit before it.
struct UnitRuntime {
  std::shared_ptr<const UnitState> st;
  std::mutex mu;
  std::weak_ptr<UnitRuntime> next;  // learned from the previous forward
  std::optional<comm::PendingResult> prefetched;
  std::vector<int64_t> prefetched_versions;  // of the shards when the prefetch started

  // Starts the forward all-gather now (no-op when one is in flight).
  void prefetch() {
    std::lock_guard<std::mutex> l(mu);
    if (prefetched || has_kept(*st)) return;
    at::NoGradGuard no_grad;
    prefetched = all_gather_shards_async(*st);
    prefetched_versions = shard_versions();
  }

  // The prefetched gather as [dp, segment], or undefined when there is none or the shards
  // changed since it started (then it is stale, and the caller gathers afresh).
  at::Tensor take_prefetched() {
    std::lock_guard<std::mutex> l(mu);
    if (!prefetched) return {};
    at::Tensor gathered = prefetched->wait();
    prefetched.reset();
    if (shard_versions() != prefetched_versions) return {};
    return gathered.view({st->dp, st->segment});
  }

  std::vector<int64_t> shard_versions() const { return fsdp::shard_versions(*st); }
};

// Parameter i, whole, from the gathered buffer: a copy, or a view of the buffer when reshaping
// copies nothing (dp = 1, or a unit of one parameter); see GatheredCall::kept_storage.
at::Tensor unpack(const UnitState& st, const at::Tensor& gathered, size_t i) {
  const auto& p = st.params[i];
  std::vector<int64_t> padded = p.full_shape;
  padded[0] = st.dp * p.chunk_rows;
  return gathered.narrow(1, p.offset, p.chunk_rows * p.row_numel)
      .reshape(padded)
      .narrow(0, 0, p.full_shape[0])
      .contiguous();
}

// The gathered parameters of one forward call of a unit, by storage: their values can be freed
// (the storage resized to 0 bytes) while autograd still holds the tensors, and gathered again
// into the same storage before backward needs them. It holds storages, not the tensors: the
// tensors' grad_fn holds this object, and holding them here would make a cycle.
struct GatheredCall : torch::CustomClassHolder {
  struct View {
    c10::Storage storage;
    int64_t offset;
    std::vector<int64_t> sizes, strides;
  };
  std::shared_ptr<const UnitState> unit;                  // shared: backward may outlive the module
  std::vector<View> views;                                // one per parameter
  std::vector<std::pair<c10::Storage, size_t>> storages;  // distinct storages, full byte size
  // The unit's kept buffer (gradient sync off) when the parameters came from it: views of it
  // (unpack) are neither freed nor gathered again, since later forwards read the buffer.
  c10::Storage kept_storage;
  bool freed = false;
  std::mutex mu;          // backward hooks of one call may run on different engine threads
  at::Tensor prefetched;  // the forward's all-gather, when started ahead (consumed by forward)
  // The backward all-gather, started ahead by the unit whose backward runs before this one's.
  std::optional<comm::PendingResult> pending;
  // Starts the regather of the unit whose forward ended just before this one's in the same
  // outermost forward (its backward comes right after this one's); holds it weakly. Empty:
  // none.
  std::function<void()> prefetch_prev;
  bool prefetched_prev = false;

  explicit GatheredCall(std::shared_ptr<const UnitState> u) : unit(std::move(u)) {}

  // The last strong reference is gone, but a weak one (the forward tracking of this thread)
  // keeps the object, members included, until it is replaced: drop what it holds now, or the
  // storages, a pending all-gather and the chain of calls prefetch_prev reaches outlive the
  // step (and the model: a second simulation in one process saw them freed in its own step).
  void release_resources() override {
    if (pending) {
      try {
        pending->wait();
      } catch (...) {
        // The collective failed: nobody is left to read it; the failure is reported elsewhere.
      }
    }
    pending.reset();
    prefetched = at::Tensor();
    prefetch_prev = nullptr;
    views.clear();
    storages.clear();
    kept_storage = c10::Storage();
    unit.reset();
  }

  bool is_kept(const c10::Storage& s) const { return kept_storage && s.is_alias_of(kept_storage); }

  void remember(const torch::autograd::variable_list& params) {
    std::unordered_set<const c10::StorageImpl*> seen;
    for (const at::Tensor& t : params) {
      views.push_back(View{t.storage(), t.storage_offset(), t.sizes().vec(), t.strides().vec()});
      if (seen.insert(t.storage().unsafeGetStorageImpl()).second)
        storages.emplace_back(t.storage(), t.storage().nbytes());
    }
  }

  // Drops the gathered values; the tensors keep their shapes over 0-byte storages.
  void free() {
    std::lock_guard<std::mutex> l(mu);
    if (pending) {  // never consumed (no gradient reached the unit): finish it, drop it
      pending->wait();
      pending.reset();
    }
    if (freed) return;
    for (auto& [s, nbytes] : storages)
      if (!is_kept(s)) s.unsafeGetStorageImpl()->reset();
    freed = true;
  }

  // Starts the all-gather regather() needs now (no-op unless freed and none is in flight).
  void prefetch_regather() {
    std::lock_guard<std::mutex> l(mu);
    if (!freed || pending || has_kept(*unit)) return;
    at::NoGradGuard no_grad;
    pending = all_gather_shards_async(*unit);
  }

  // Before the unit's backward: one all-gather (or the one prefetched), into the storages free()
  // emptied; then the all-gather of the unit whose backward comes next is started.
  void regather() {
    regather_own();
    {
      std::lock_guard<std::mutex> l(mu);
      if (!unit->prefetch || !prefetch_prev || prefetched_prev || comm::collectives_taped()) return;
      prefetched_prev = true;  // once: a later gradient of another output must not start more
    }
    prefetch_prev();
  }

  void regather_own() {
    std::lock_guard<std::mutex> l(mu);
    if (!freed) return;
    const UnitState& st = *unit;
    at::NoGradGuard no_grad;
    const at::Tensor gathered =
        gathered_shards(st, pending ? pending->wait().view({st.dp, st.segment}) : at::Tensor());
    pending.reset();
    for (auto& [s, nbytes] : storages) {
      if (is_kept(s)) continue;  // never freed
      c10::StorageImpl* impl = s.unsafeGetStorageImpl();
      TORCH_CHECK(impl->allocator() != nullptr, "fully_shard(", st.unit_name,
                  "): the gathered parameters' storage has no allocator to gather them again "
                  "before backward");
      impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
      impl->set_nbytes(nbytes);
    }
    for (size_t i = 0; i < views.size(); ++i) {
      // A new tensor over the storage: writing through it leaves the saved tensors' version
      // counters alone, so autograd does not see an in-place change.
      const View& v = views[i];
      if (is_kept(v.storage)) continue;
      at::Tensor alias =
          at::empty({0}, gathered.options()).set_(v.storage, v.offset, v.sizes, v.strides);
      alias.copy_(unpack(st, gathered, i));
    }
    freed = false;
  }
};

// The unit's parameters from its shards: one all-gather forward, one reduce-scatter backward.
struct GatherParams : torch::autograd::Function<GatherParams> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::IValue call_capsule, at::TensorList shards) {
    auto* call = static_cast<GatheredCall*>(call_capsule.toCapsule().get());
    const UnitState& st = *call->unit;
    TORCH_INTERNAL_ASSERT(shards.size() == st.params.size());
    const at::Tensor gathered = gathered_shards(st, call->prefetched);
    call->prefetched = at::Tensor();
    {
      std::lock_guard<std::mutex> l(st.sync->mu);
      if (st.sync->kept.defined() && st.sync->kept.is_same(gathered))
        call->kept_storage = gathered.storage();
    }
    torch::autograd::variable_list out;
    out.reserve(st.params.size());
    for (size_t i = 0; i < st.params.size(); ++i) out.push_back(unpack(st, gathered, i));
    call->remember(out);
    ctx->saved_data["call"] = std::move(call_capsule);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* call = static_cast<GatheredCall*>(ctx->saved_data["call"].toCapsule().get());
    const UnitState& st = *call->unit;
    const auto opts = st.shard_options().dtype(st.grad_reduce_dtype());
    at::Tensor buf = at::zeros({st.dp, st.segment}, opts);
    for (size_t i = 0; i < st.params.size(); ++i) {
      const auto& p = st.params[i];
      if (!grads[i].defined()) continue;  // unused parameter: zero gradient
      at::Tensor padded = at::zeros({st.dp * p.chunk_rows, p.row_numel}, opts);
      padded.narrow(0, 0, p.full_shape[0]).copy_(grads[i].reshape({p.full_shape[0], -1}));
      buf.narrow(1, p.offset, p.chunk_rows * p.row_numel)
          .copy_(padded.view({st.dp, p.chunk_rows * p.row_numel}));
    }
    // Every consumer of the gathered parameters has run its backward: free them (a second
    // backward through a retained graph gathers them again).
    call->free();
    {
      // Deferred: accumulate, leave the shards' .grad alone. Else add what was deferred and
      // reduce-scatter all of it once.
      std::lock_guard<std::mutex> l(st.sync->mu);
      SyncState& s = *st.sync;
      if (!s.requires_sync) {
        s.grad_acc = s.grad_acc.defined() ? s.grad_acc.add_(buf) : buf;
        return torch::autograd::variable_list(st.params.size() + 1);
      }
      if (s.grad_acc.defined()) buf.add_(s.grad_acc);
      s.grad_acc = at::Tensor();
      s.kept = at::Tensor();
    }
    // Sum then divide: the mean over dp of the ranks' gradients, as data parallelism needs;
    // in the shards' dtype (mixed precision reduces in reduce_dtype, divides in float32).
    at::Tensor mine = comm::reduce_scatter_tensor(buf.view({-1}), 0, ReduceOp::Sum, *st.pg)
                          .to(st.shard_dtype())
                          .div_(static_cast<double>(st.dp));
    torch::autograd::variable_list out;
    out.reserve(st.params.size() + 1);
    out.emplace_back();  // for the call
    // Each leaf's gradient: a DTensor laid out like the leaf, holding this rank's rows.
    for (const auto& p : st.params) {
      const at::Tensor rows = rows_of(p);
      out.push_back(make_dtensor(mine.narrow(0, p.offset, rows.numel()).view(rows.sizes()).clone(),
                                 dtensor_impl(p.shard)->spec()));
    }
    return out;
  }
};

// Casts the floating-point tensors among the call's arguments (top level) to `dtype`, so that
// a unit computing in param_dtype receives inputs of that dtype.
void cast_floating_args(tp::ModuleCall& call, at::ScalarType dtype) {
  auto cast = [dtype](c10::IValue& v) {
    if (!v.isTensor()) return;
    const at::Tensor& t = v.toTensor();
    if (t.defined() && at::isFloatingType(t.scalar_type()) && t.scalar_type() != dtype)
      v = t.to(dtype);
  };
  for (auto& a : call.args) cast(a);
  for (auto& [k, v] : call.kwargs) cast(v);
}

// The units' forward calls on this thread: how deep in units, the unit started last and the
// call whose forward ended last within the outermost unit's forward. A unit's forward that
// starts while another runs follows the one started before it (forward prefetch), and a
// unit's backward follows the backward of the unit whose forward ended right after its own.
struct ForwardTrack {
  int depth = 0;
  std::weak_ptr<UnitRuntime> last_started;
  std::optional<c10::weak_intrusive_ptr<GatheredCall>> last_done;
};
ForwardTrack& forward_track() {
  thread_local ForwardTrack track;
  return track;
}

void collect(torch::nn::Module& m, const std::string& prefix, UnitState& st,
             std::unordered_set<const c10::TensorImpl*>& seen) {
  for (auto& p : m.named_parameters(/*recurse=*/false)) {
    const at::Tensor& t = p.value();
    if (!t.defined()) continue;
    const std::string fqn = prefix.empty() ? p.key() : prefix + "." + p.key();
    {
      std::lock_guard<std::mutex> l(shards_mu());
      if (find_shard(t)) continue;  // a child unit's shard
    }
    std::shared_ptr<const DTensorSpec> tp_spec;
    at::Tensor value = t;
    if (is_dtensor(t)) {  // sharded over dp: this rank's tp-local tensor
      tp_spec = std::make_shared<const DTensorSpec>(spec_of(t));
      TORCH_CHECK(!tp_spec->mesh().contains_this_rank() || tp_spec->mesh().ndim() == 1,
                  "fully_shard(", st.unit_name, "): parameter ", fqn, " is a DTensor on ",
                  tp_spec->mesh().str(), "; fully_shard takes DTensors on a 1-D (tp) mesh only");
      value = dtensor_impl(t)->local().detach();
      value.set_requires_grad(t.requires_grad());
    }
    TORCH_CHECK(value.dim() >= 1, "fully_shard(", st.unit_name, "): parameter ", fqn,
                " is 0-d; fully_shard splits dim 0 and needs at least one dimension");
    TORCH_CHECK(seen.insert(t.unsafeGetTensorImpl()).second, "fully_shard(", st.unit_name,
                "): parameter ", fqn,
                " is tied to another parameter of the unit; tied parameters are not supported yet");
    st.params.push_back(ParamSlot{&m, p.key(), value.sizes().vec(), 0, 0, 0, value, tp_spec});
  }
  for (auto& c : m.named_children())
    collect(*c.value(), prefix.empty() ? c.key() : prefix + "." + c.key(), st, seen);
}

}  // namespace

bool is_fsdp_shard(const at::Tensor& param) {
  if (!param.defined()) return false;
  std::lock_guard<std::mutex> l(shards_mu());
  return find_shard(param) != nullptr;
}

ShardInfo shard_info(const at::Tensor& param) {
  TORCH_CHECK(param.defined(), "fsdp::shard_info: the tensor is undefined");
  std::lock_guard<std::mutex> l(shards_mu());
  const ShardEntry* e = find_shard(param);
  TORCH_CHECK(e, "fsdp::shard_info: the tensor (shape ", param.sizes(),
              ") is not a parameter shard created by fully_shard");
  return e->info;
}

namespace {

// The checks fully_shard makes before touching the unit; returns the unit's hooks.
tp::HookedModule& checked_unit(torch::nn::Module& unit, const DeviceMesh& dp_mesh,
                               const FullyShardOptions& options) {
  const std::string uname = unit.name();
  TORCH_CHECK(dp_mesh.ndim() == 1, "fully_shard(", uname,
              "): expected a 1-D data-parallel mesh, got ", dp_mesh.str(), " with ", dp_mesh.ndim(),
              " dims; pass the dp sub-mesh, e.g. mesh[\"dp\"]");
  TORCH_CHECK(dp_mesh.contains_this_rank(), "fully_shard(", uname, "): this rank is not in ",
              dp_mesh.str(), "; every rank must pass the dp mesh it belongs to");
  for (auto dt : {options.param_dtype, options.reduce_dtype})
    TORCH_CHECK(!dt || at::isFloatingType(*dt), "fully_shard(", uname,
                "): param_dtype and reduce_dtype must be floating-point dtypes, got ", *dt);
  auto* hooked = dynamic_cast<tp::HookedModule*>(&unit);
  TORCH_CHECK(hooked, "fully_shard(", uname,
              "): the unit has no forward hooks; derive it from dtensor::nn::Module (or use a "
              "dtensor::nn layer) so fully_shard can gather its parameters before forward");
  return *hooked;
}

// The layout of a parameter's leaf: Shard(0) over dp, of the parameter itself or, for a TP
// DTensor, of its tp-local tensor: the leaf's mesh is then (tp, dp) and its placements TP's
// followed by Shard(0), since a DTensor's mesh dims shard one after the other, each the local
// tensor the dims before it left (so no strided placement is needed, as it is with dp first).
SpecPtr leaf_spec(const ParamSlot& p, const DeviceMesh& dp_mesh, at::ScalarType dtype) {
  if (!p.tp_spec)
    return make_spec(dp_mesh, {Shard(0)},
                     TensorMeta{p.full_shape, default_strides(p.full_shape), dtype});
  const DTensorSpec& tp = *p.tp_spec;
  Placements placements(tp.placements().begin(), tp.placements().end());
  placements.push_back(Shard(0));
  std::optional<DeviceMesh> mesh;
  try {
    mesh = DeviceMesh::concatenate({tp.mesh(), dp_mesh});
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "fully_shard: parameter '", p.name, "' is a DTensor on ", tp.mesh().str(),
                ", which with the dp mesh ", dp_mesh.str(),
                " does not form one mesh: slice both from one init_device_mesh (",
                e.what_without_backtrace(), ")");
  }
  return make_spec(*mesh, placements, TensorMeta{tp.shape(), tp.stride(), dtype});
}

// Cuts each collected parameter to this rank's rows (torch.chunk: full chunks first, so
// trailing ranks may hold fewer or no rows), lays the shards out in one flat segment, makes
// each shard a DTensor leaf and lists them in the shard registry.
void shard_parameters(UnitState& st, const DeviceMesh& dp_mesh) {
  const int64_t rank = dp_mesh.get_local_rank();
  // Every leaf's layout first: a refusal leaves the module as it was.
  std::vector<SpecPtr> specs;
  for (const auto& p : st.params) specs.push_back(leaf_spec(p, dp_mesh, p.shard.scalar_type()));
  std::vector<ShardInfo> infos;
  for (size_t i = 0; i < st.params.size(); ++i) {
    ParamSlot& p = st.params[i];
    const int64_t rows = p.full_shape[0];
    p.chunk_rows = (rows + st.dp - 1) / st.dp;
    p.row_numel = rows == 0 ? 0 : p.shard.numel() / rows;
    p.offset = st.segment;
    st.segment += p.chunk_rows * p.row_numel;
    const int64_t begin = std::min(rows, rank * p.chunk_rows);
    const int64_t end = std::min(rows, begin + p.chunk_rows);
    const bool rg = p.shard.requires_grad();
    at::Tensor rows_here = p.shard.detach().narrow(0, begin, end - begin).clone();
    p.shard = make_dtensor(std::move(rows_here), specs[i]).set_requires_grad(rg);
    replace_parameter(*p.owner, p.name, p.shard);
    infos.push_back(ShardInfo{rows, begin, st.pg, p.tp_spec});
  }
  std::lock_guard<std::mutex> l(shards_mu());
  for (size_t i = 0; i < st.params.size(); ++i)
    shards().insert_or_assign(
        st.params[i].shard.unsafeGetTensorImpl(),
        ShardEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(st.params[i].shard.getIntrusivePtr()),
                   infos[i]});
}

// The call between the pre-hook and the hook of one forward (not in UnitState: a call holds
// the state, and the state holding a call would make a cycle).
using CurrentCall = std::shared_ptr<c10::intrusive_ptr<GatheredCall>>;

// Before the unit's forward: gathers (or takes the prefetched) full parameters, puts them in
// the modules, and starts the next unit's gather.
void before_forward(const std::shared_ptr<UnitRuntime>& runtime, const CurrentCall& current,
                    tp::ModuleCall& module_call) {
  const std::shared_ptr<const UnitState>& cst = runtime->st;
  if (cst->param_dtype) cast_floating_args(module_call, *cst->param_dtype);
  ForwardTrack& track = forward_track();
  if (track.depth == 0) track.last_done.reset();  // an outermost forward begins
  if (track.depth > 0)
    if (auto last = track.last_started.lock(); last && last != runtime) {
      std::lock_guard<std::mutex> l(last->mu);
      last->next = runtime;
    }
  track.last_started = runtime;
  ++track.depth;
  // Inside a recorded or replayed region (a checkpointed module's forward and its
  // recompute) every gather must be issued where it was recorded: no prefetching there.
  const bool may_prefetch = cst->prefetch && !comm::collectives_taped();
  std::vector<at::Tensor> shard_list;
  for (const auto& p : cst->params) shard_list.push_back(p.shard);
  auto call = c10::make_intrusive<GatheredCall>(cst);
  // Taken even where it may not be used, so that a gather in flight is finished first.
  at::Tensor prefetched = runtime->take_prefetched();
  if (may_prefetch) call->prefetched = prefetched;
  *current = call;
  auto full = GatherParams::apply(
      c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(call)),
      at::TensorList(shard_list));
  for (size_t i = 0; i < cst->params.size(); ++i) {
    const ParamSlot& p = cst->params[i];
    const DTensorSpec* s = p.tp_spec.get();
    // from_local's backward moves the gradient back to the parameter's placements (a
    // Partial one is summed over tp) before the reduce-scatter over dp.
    replace_parameter(*p.owner, p.name,
                      s ? from_local(full[i], s->mesh(), s->placements(),
                                     FromLocalOptions{.shape = s->shape(), .stride = s->stride()})
                        : full[i]);
  }
  // The next unit's all-gather runs while this unit computes.
  if (may_prefetch) {
    std::shared_ptr<UnitRuntime> next;
    {
      std::lock_guard<std::mutex> l(runtime->mu);
      next = runtime->next.lock();
    }
    if (next) next->prefetch();
  }
}

// After forward the modules list the shards again (the autograd graph keeps the gathered
// tensors it needs for backward), so parameters() and the optimizer see the leaves. With
// reshard_after_forward the gathered values are freed now and gathered again when the first
// gradient reaches one of the unit's outputs, i.e. before any of the unit's backward runs.
void after_forward(const UnitState& st, const CurrentCall& current, c10::IValue& output) {
  for (const auto& p : st.params) replace_parameter(*p.owner, p.name, p.shard);
  c10::intrusive_ptr<GatheredCall> call = std::move(*current);
  *current = {};
  ForwardTrack& track = forward_track();
  if (track.depth > 0) --track.depth;
  if (!call) return;
  if (track.last_done)
    call->prefetch_prev = [prev = *track.last_done] {
      if (c10::intrusive_ptr<GatheredCall> p = prev.lock()) p->prefetch_regather();
    };
  track.last_done = c10::weak_intrusive_ptr<GatheredCall>(call);
  if (c10::GradMode::is_enabled()) {
    detail::for_each_tensor(output, [&](const at::Tensor& t) {
      if (t.defined() && t.requires_grad())
        t.register_hook([call](const at::Tensor&) { call->regather(); });
    });
  }
  if (st.reshard_after_forward) call->free();
}

}  // namespace

void fully_shard(torch::nn::Module& unit, const DeviceMesh& dp_mesh, FullyShardOptions options) {
  tp::HookedModule& hooked = checked_unit(unit, dp_mesh, options);
  prune_dead_shards();
  auto st = std::make_shared<UnitState>();
  st->unit_name = unit.name();
  st->pg = dp_mesh.get_group(0);
  st->dp = dp_mesh.size();
  st->reshard_after_forward = options.reshard_after_forward;
  st->prefetch = options.prefetch;
  st->param_dtype = options.param_dtype;
  st->reduce_dtype = options.reduce_dtype;
  std::unordered_set<const c10::TensorImpl*> seen;
  collect(unit, "", *st, seen);
  if (st->params.empty()) return;  // nothing left to shard (every parameter in child units)
  shard_parameters(*st, dp_mesh);
  detail::register_sync_unit(unit, st->sync);

  auto current = std::make_shared<c10::intrusive_ptr<GatheredCall>>();
  std::shared_ptr<const UnitState> cst = st;
  auto runtime = std::make_shared<UnitRuntime>();
  runtime->st = cst;
  hooked.register_forward_pre_hook(
      [runtime, current](torch::nn::Module&, tp::ModuleCall& module_call) {
        before_forward(runtime, current, module_call);
      });
  hooked.register_forward_hook(
      [cst, current](torch::nn::Module&, const tp::ModuleCall&, c10::IValue& output) {
        after_forward(*cst, current, output);
      });
}

}  // namespace dtensor::fsdp
