#include "dtensor/tp/partial_grads.h"

#include <ATen/ops/cat.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <unordered_set>

#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"

namespace dtensor::tp {
namespace {

struct Group {
  const DTensorSpec* spec;  // mesh and placements shared by the group
  c10::ScalarType dtype;
  c10::Device device;
  std::vector<at::Tensor> params;
};

}  // namespace

int64_t reduce_partial_grads(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  std::vector<Group> groups;
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t reduced = 0;
  for (const at::Tensor& p : params) {
    if (!p.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    const at::Tensor& g = p.grad();
    if (!g.defined() || !is_dtensor(g)) continue;
    const auto& spec = *dtensor_impl(g)->spec();
    const auto& pl = spec.placements();
    if (!spec.has_partial()) continue;
    ++reduced;
    // Sharded gradients keep their layout; only shard-free ones flatten into a shared buffer.
    // Sums over one rank are relabels: no buffer either (no op at TP=1).
    bool communicates = false;
    for (size_t m = 0; m < pl.size(); ++m) {
      communicates |= pl[m].is_partial() && spec.mesh().size(static_cast<int64_t>(m)) > 1;
    }
    if (spec.has_shard() || !communicates) {
      p.mutable_grad() = redistribute(g, clear_partial(pl));
      continue;
    }
    const at::Tensor& local = dtensor_impl(g)->local();
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& gr) {
      return gr.spec->mesh() == spec.mesh() && gr.spec->placements() == pl &&
             gr.dtype == local.scalar_type() && gr.device == local.device();
    });
    if (it == groups.end()) {
      groups.push_back(Group{&spec, local.scalar_type(), local.device(), {}});
      it = std::prev(groups.end());
    }
    it->params.push_back(p);
  }
  for (auto& gr : groups) {
    const DeviceMesh mesh =
        gr.spec->mesh();  // a copy: the grads holding the spec are replaced below
    const Placements pl = gr.spec->placements();
    const Placements target = clear_partial(pl);
    if (gr.params.size() == 1) {
      at::Tensor& grad = gr.params[0].mutable_grad();
      grad = redistribute(grad, target);
      continue;
    }
    std::vector<at::Tensor> flat;
    for (const auto& p : gr.params) flat.push_back(dtensor_impl(p.grad())->local().reshape(-1));
    at::Tensor sum = to_local(redistribute(from_local(at::cat(flat), mesh, pl), target));
    int64_t offset = 0;
    for (auto& p : gr.params) {
      const at::Tensor& local = dtensor_impl(p.grad())->local();
      at::Tensor piece = sum.narrow(0, offset, local.numel()).view(local.sizes());
      offset += local.numel();
      p.mutable_grad() = from_local(piece, mesh, target);
    }
  }
  return reduced;
}

int64_t reduce_partial_grads(torch::nn::Module& module) {
  return reduce_partial_grads(module.parameters());
}

}  // namespace dtensor::tp
