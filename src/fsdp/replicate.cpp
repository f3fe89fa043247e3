// replicate: see include/dtensor/fsdp/replicate.h.
#include "dtensor/fsdp/replicate.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <atomic>
#include <memory>
#include <vector>

#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/tp/module_hooks.h"
#include "dtensor/tp/partial_grads.h"
#include "sync_units.h"

namespace dtensor::fsdp {
namespace {

struct ReplicaState : detail::GradientSync {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<comm::ProcessGroup> pg;
  int64_t dp = 1;
  int64_t bucket_bytes = 0;
  // Set when a backward through the module has queued its averaging, until that runs.
  std::atomic<bool> queued{false};
};

// The local tensors of the gradients to average, in bucket order: each bucket one dtype, at most
// `bucket_bytes` unless a single gradient is larger.
std::vector<std::vector<at::Tensor>> buckets_of(const std::vector<at::Tensor>& locals,
                                                int64_t bucket_bytes) {
  std::vector<std::vector<at::Tensor>> out;
  int64_t bytes = 0;
  for (const at::Tensor& l : locals) {
    const int64_t n = l.numel() * static_cast<int64_t>(l.element_size());
    const bool fits = !out.empty() && out.back().front().scalar_type() == l.scalar_type() &&
                      (bucket_bytes == 0 || bytes + n <= bucket_bytes);
    if (!fits) {
      out.emplace_back();
      bytes = 0;
    }
    out.back().push_back(l);
    bytes += n;
  }
  return out;
}

// This rank's local part of every gradient the module's parameters hold (each parameter once).
std::vector<at::Tensor> local_grads(torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : unique_parameters(module)) {
    const at::Tensor& g = p.grad();
    if (g.defined()) out.push_back(is_dtensor(g) ? local_tensor(g) : g);
  }
  return out;
}

// The end of a backward through the module: pending TP sums settled (every replica needs them
// reduced anyway, and a replica's average is then over settled values), then each bucket summed
// over dp and divided by dp.
void average_gradients(ReplicaState& st) {
  st.queued = false;
  {
    std::lock_guard<std::mutex> l(st.mu);
    if (!st.requires_sync) return;
  }
  const std::shared_ptr<torch::nn::Module> module = st.module.lock();
  if (!module) return;
  at::NoGradGuard no_grad;
  tp::reduce_partial_grads(*module);
  for (const auto& bucket : buckets_of(local_grads(*module), st.bucket_bytes)) {
    std::vector<at::Tensor> flat;
    for (const auto& l : bucket) flat.push_back(l.reshape({-1}));
    at::Tensor summed = comm::all_reduce(at::cat(flat), ReduceOp::Sum, *st.pg);
    summed.div_(static_cast<double>(st.dp));
    int64_t offset = 0;
    for (const auto& l : bucket) {
      l.copy_(summed.narrow(0, offset, l.numel()).view(l.sizes()));
      offset += l.numel();
    }
  }
}

}  // namespace

void replicate(torch::nn::Module& module, const DeviceMesh& dp_mesh, ReplicateOptions options) {
  auto* hooked = dynamic_cast<tp::HookedModule*>(&module);
  TORCH_CHECK(hooked, "replicate: module '", module.name(),
              "' has no forward hooks; derive it from dtensor::nn::Module (or use a dtensor::nn "
              "layer)");
  TORCH_CHECK(dp_mesh.ndim() == 1, "replicate: needs a 1-D dp mesh, got ", dp_mesh.str());
  TORCH_CHECK(options.bucket_bytes >= 0, "replicate: bucket_bytes must be >= 0, got ",
              options.bucket_bytes);
  auto st = std::make_shared<ReplicaState>();
  st->module = module.weak_from_this();
  TORCH_CHECK(!st->module.expired(), "replicate: module '", module.name(),
              "' must be owned by a shared_ptr (a module holder's)");
  st->pg = dp_mesh.get_group(0);
  st->dp = dp_mesh.size();
  st->bucket_bytes = options.bucket_bytes;
  detail::register_sync_unit(module, st);
  // The first gradient to reach an output of a forward queues the averaging for the end of that
  // backward pass, when every gradient has been accumulated.
  hooked->register_forward_hook([st](torch::nn::Module&, const tp::ModuleCall&, c10::IValue& out) {
    // A backward that failed never ran its callback: each forward starts afresh.
    st->queued = false;
    if (!c10::GradMode::is_enabled()) return;
    detail::for_each_tensor(out, [&](const at::Tensor& t) {
      if (!t.defined() || !t.requires_grad()) return;
      t.register_hook([weak = std::weak_ptr<ReplicaState>(st)](const at::Tensor&) {
        const auto s = weak.lock();
        if (!s || s->queued.exchange(true)) return;
        torch::autograd::Engine::get_default_engine().queue_callback([weak] {
          if (const auto s = weak.lock()) average_gradients(*s);
        });
      });
    });
  });
}

int64_t replicate_buckets(torch::nn::Module& module, int64_t bucket_bytes) {
  std::vector<at::Tensor> locals;
  for (const at::Tensor& p : unique_parameters(module)) {
    if (!p.requires_grad()) continue;
    const at::Tensor l = is_dtensor(p) ? local_tensor(p) : p;
    locals.push_back(at::empty(l.sizes(), l.options().device(at::kMeta)));
  }
  return static_cast<int64_t>(buckets_of(locals, bucket_bytes).size());
}

}  // namespace dtensor::fsdp
