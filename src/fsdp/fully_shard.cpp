// fully_shard: see include/dtensor/fsdp/fully_shard.h.
#include "dtensor/fsdp/fully_shard.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "dtensor/comm/collectives.h"
#include "dtensor/comm/process_group.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/tp/module_hooks.h"

namespace dtensor::fsdp {
namespace {

// Every leaf fully_shard created, so a parent unit leaves its children's parameters alone. The
// weak reference keeps a dead shard's TensorImpl allocation (not its storage) until the entry is
// pruned, so a later tensor cannot take its address and pass for a shard.
struct ShardEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  ShardInfo info;
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
  at::Tensor shard;    // the leaf the optimizer steps: this rank's rows, unpadded
};

struct UnitState {
  std::string unit_name;
  std::shared_ptr<comm::ProcessGroup> pg;
  int64_t dp = 1;
  int64_t segment = 0;  // elements of one rank's flat buffer
  std::vector<ParamSlot> params;
};

// The unit's parameters from its shards: one all-gather forward, one reduce-scatter backward.
struct GatherParams : torch::autograd::Function<GatherParams> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                UnitState* st, at::TensorList shards) {
    ctx->saved_data["state"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(st));
    const auto opts = shards[0].options();
    at::Tensor flat = at::zeros({st->segment}, opts);
    for (size_t i = 0; i < st->params.size(); ++i) {
      const auto& p = st->params[i];
      flat.narrow(0, p.offset, shards[i].numel()).copy_(shards[i].reshape({-1}));
    }
    at::Tensor gathered =
        comm::all_gather_into_tensor(flat, 0, *st->pg).view({st->dp, st->segment});
    torch::autograd::variable_list out;
    out.reserve(st->params.size());
    for (const auto& p : st->params) {
      std::vector<int64_t> padded = p.full_shape;
      padded[0] = st->dp * p.chunk_rows;
      out.push_back(gathered.narrow(1, p.offset, p.chunk_rows * p.row_numel)
                        .reshape(padded)
                        .narrow(0, 0, p.full_shape[0])
                        .contiguous());
    }
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* st =
        reinterpret_cast<UnitState*>(static_cast<intptr_t>(ctx->saved_data["state"].toInt()));
    const auto opts = st->params[0].shard.options();
    at::Tensor buf = at::zeros({st->dp, st->segment}, opts);
    for (size_t i = 0; i < st->params.size(); ++i) {
      const auto& p = st->params[i];
      if (!grads[i].defined()) continue;  // unused parameter: zero gradient
      at::Tensor padded = at::zeros({st->dp * p.chunk_rows, p.row_numel}, opts);
      padded.narrow(0, 0, p.full_shape[0]).copy_(grads[i].reshape({p.full_shape[0], -1}));
      buf.narrow(1, p.offset, p.chunk_rows * p.row_numel)
          .copy_(padded.view({st->dp, p.chunk_rows * p.row_numel}));
    }
    // Sum then divide: the mean over dp of the ranks' gradients, as data parallelism needs.
    at::Tensor mine = comm::reduce_scatter_tensor(buf.view({-1}), 0, ReduceOp::Sum, *st->pg)
                          .div_(static_cast<double>(st->dp));
    torch::autograd::variable_list out;
    out.reserve(st->params.size() + 1);
    out.emplace_back();  // for `st`
    for (const auto& p : st->params)
      out.push_back(mine.narrow(0, p.offset, p.shard.numel()).view(p.shard.sizes()).clone());
    return out;
  }
};

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
    TORCH_CHECK(!is_dtensor(t), "fully_shard(", st.unit_name, "): parameter ", fqn,
                " is a DTensor; this first fully_shard supports plain tensors only (shard "
                "tensor-parallel models later, or apply fully_shard without tensor parallelism)");
    TORCH_CHECK(t.dim() >= 1, "fully_shard(", st.unit_name, "): parameter ", fqn,
                " is 0-d; fully_shard splits dim 0 and needs at least one dimension");
    TORCH_CHECK(seen.insert(t.unsafeGetTensorImpl()).second, "fully_shard(", st.unit_name,
                "): parameter ", fqn,
                " is tied to another parameter of the unit; tied parameters are not supported yet");
    st.params.push_back(ParamSlot{&m, p.key(), t.sizes().vec(), 0, 0, 0, t});
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

void fully_shard(torch::nn::Module& unit, const DeviceMesh& dp_mesh, FullyShardOptions options) {
  const std::string uname = unit.name();
  TORCH_CHECK(!options.reshard_after_forward, "fully_shard(", uname,
              "): reshard_after_forward=true is not implemented yet; the gathered parameters "
              "stay alive until backward (pass reshard_after_forward=false)");
  TORCH_CHECK(dp_mesh.ndim() == 1, "fully_shard(", uname,
              "): expected a 1-D data-parallel mesh, got ", dp_mesh.str(), " with ", dp_mesh.ndim(),
              " dims; pass the dp sub-mesh, e.g. mesh[\"dp\"]");
  TORCH_CHECK(dp_mesh.contains_this_rank(), "fully_shard(", uname, "): this rank is not in ",
              dp_mesh.str(), "; every rank must pass the dp mesh it belongs to");
  auto* hooked = dynamic_cast<tp::HookedModule*>(&unit);
  TORCH_CHECK(hooked, "fully_shard(", uname,
              "): the unit has no forward hooks; derive it from dtensor::nn::Module (or use a "
              "dtensor::nn layer) so fully_shard can gather its parameters before forward");

  prune_dead_shards();
  auto st = std::make_shared<UnitState>();
  st->unit_name = uname;
  st->pg = dp_mesh.get_group(0);
  st->dp = dp_mesh.size();
  const int64_t rank = dp_mesh.get_local_rank();
  std::unordered_set<const c10::TensorImpl*> seen;
  collect(unit, "", *st, seen);
  if (st->params.empty()) return;  // nothing left to shard (every parameter in child units)

  std::vector<ShardInfo> infos;
  for (auto& p : st->params) {
    const int64_t rows = p.full_shape[0];
    p.chunk_rows = (rows + st->dp - 1) / st->dp;
    p.row_numel = rows == 0 ? 0 : p.shard.numel() / rows;
    p.offset = st->segment;
    st->segment += p.chunk_rows * p.row_numel;
    // torch.chunk: full chunks first, so trailing ranks may hold fewer (or no) rows.
    const int64_t begin = std::min(rows, rank * p.chunk_rows);
    const int64_t end = std::min(rows, begin + p.chunk_rows);
    const bool rg = p.shard.requires_grad();
    p.shard = p.shard.detach().narrow(0, begin, end - begin).clone().set_requires_grad(rg);
    replace_parameter(*p.owner, p.name, p.shard);
    infos.push_back(ShardInfo{rows, begin});
  }
  {
    std::lock_guard<std::mutex> l(shards_mu());
    for (size_t i = 0; i < st->params.size(); ++i)
      shards().insert_or_assign(st->params[i].shard.unsafeGetTensorImpl(),
                                ShardEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(
                                               st->params[i].shard.getIntrusivePtr()),
                                           infos[i]});
  }

  hooked->register_forward_pre_hook([st](torch::nn::Module&, tp::ModuleCall&) {
    std::vector<at::Tensor> shard_list;
    for (const auto& p : st->params) shard_list.push_back(p.shard);
    auto full = GatherParams::apply(st.get(), at::TensorList(shard_list));
    for (size_t i = 0; i < st->params.size(); ++i)
      replace_parameter(*st->params[i].owner, st->params[i].name, full[i]);
  });
  // After forward the modules list the shards again (the autograd graph keeps the gathered
  // values it needs for backward), so parameters() and the optimizer see the leaves.
  hooked->register_forward_hook([st](torch::nn::Module&, const tp::ModuleCall&, c10::IValue&) {
    for (const auto& p : st->params) replace_parameter(*p.owner, p.name, p.shard);
  });
}

}  // namespace dtensor::fsdp
