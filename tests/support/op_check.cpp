#include "support/op_check.h"

#include <cstdio>
#include <sstream>

#include "support/distributed.h"

namespace dtensor::testing {
namespace {

at::Tensor distribute(const at::Tensor& g, const DeviceMesh& mesh, const Placements& p, bool grad) {
  int64_t partial = 1;
  bool has_partial = false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i].is_partial()) partial *= mesh.size(static_cast<int64_t>(i));
    has_partial |= p[i].is_partial();
  }
  at::Tensor out;
  if (!has_partial) {
    out = distribute_tensor(g.detach().clone(), mesh, p, std::nullopt);
  } else {
    Placements shard_only = clear_partial(p);
    auto base = distribute_tensor(g.detach().clone(), mesh, shard_only, std::nullopt);
    at::Tensor local = local_tensor(base);
    if (g.is_floating_point()) local = local / partial;
    out = from_local(local, mesh, p, {.shape = g.sizes().vec(), .stride = g.strides().vec()});
    out = out.detach();
  }
  if (grad) out.requires_grad_(true);
  return out;
}

}  // namespace

::testing::AssertionResult same_layout(const at::Tensor& actual, const at::Tensor& expected) {
  bool ok = actual.sizes() == expected.sizes();
  for (int64_t d = 0; ok && d < actual.dim(); ++d) {
    ok = actual.size(d) <= 1 || actual.stride(d) == expected.stride(d);
  }
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "sizes " << actual.sizes() << " strides " << actual.strides() << ", expected sizes "
         << expected.sizes() << " strides " << expected.strides();
}

::testing::AssertionResult grad_on_leaf_mesh(const at::Tensor& grad, const at::Tensor& leaf) {
  if (!is_dtensor(leaf) || !grad.defined()) return ::testing::AssertionSuccess();
  if (!is_dtensor(grad)) {
    return ::testing::AssertionFailure()
           << "a plain tensor " << grad.sizes() << " where the DTensor leaf on mesh "
           << device_mesh(leaf) << " needs a DTensor";
  }
  if (!(device_mesh(grad) == device_mesh(leaf))) {
    return ::testing::AssertionFailure() << "a DTensor on mesh " << device_mesh(grad)
                                         << ", the leaf is on mesh " << device_mesh(leaf);
  }
  return ::testing::AssertionSuccess();
}

bool check_op(const DeviceMesh& mesh, const std::string& label, const OpFn& fn,
              const std::vector<at::Tensor>& inputs, const std::vector<Placements>& placements,
              const OpCheckOptions& o) {
  SCOPED_TRACE(label);
  std::vector<bool> rg(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    rg[i] = o.backward && inputs[i].is_floating_point() &&
            (o.requires_grad.empty() || o.requires_grad[i]);
  }
  std::vector<at::Tensor> plain, dist;
  for (size_t i = 0; i < inputs.size(); ++i) {
    plain.push_back(inputs[i].detach().clone().requires_grad_(rg[i]));
    dist.push_back(distribute(inputs[i], mesh, placements[i], rg[i]));
  }
  std::vector<at::Tensor> ref, out;
  try {
    ref = fn(plain);
    out = fn(dist);
  } catch (const c10::Error& e) {
    ADD_FAILURE() << label << " threw: " << e.what_without_backtrace();
    return false;
  }
  if (ref.size() != out.size()) {
    ADD_FAILURE() << label << ": " << out.size() << " outputs, expected " << ref.size();
    return false;
  }
  bool ok = true;
  at::Tensor ref_loss, loss;
  at::Generator gen = at::detail::createCPUGenerator(1234);
  for (size_t k = 0; k < ref.size(); ++k) {
    at::Tensor full = is_dtensor(out[k]) ? full_tensor(out[k]) : out[k];
    auto r = tensors_close(full, ref[k], o.rtol, o.atol);
    if (!r) {
      ADD_FAILURE() << label << ": output " << k << " differs: " << r.message();
      ok = false;
    }
    if (auto l = same_layout(out[k], ref[k]); o.layout && !l) {
      ADD_FAILURE() << label << ": output " << k << " layout: " << l.message();
      ok = false;
    }
    if (!o.backward || !ref[k].is_floating_point() || !ref[k].requires_grad()) continue;
    // Drawn on the CPU (its generator), then moved: the same weights for CUDA outputs.
    at::Tensor w =
        at::randn(ref[k].sizes(), gen, ref[k].options().device(at::kCPU).requires_grad(false))
            .to(ref[k].device());
    at::Tensor rterm = o.sum_loss ? ref[k].sum() : (ref[k] * w).sum();
    at::Tensor dterm;
    if (o.sum_loss) {
      dterm = out[k].sum();
    } else if (is_dtensor(out[k])) {
      auto wd = distribute_tensor(w, device_mesh(out[k]), replicate_all(device_mesh(out[k]).ndim()),
                                  std::nullopt);
      dterm = (out[k] * wd).sum();
    } else {
      dterm = (out[k] * w).sum();
    }
    ref_loss = ref_loss.defined() ? ref_loss + rterm : rterm;
    loss = loss.defined() ? loss + dterm : dterm;
  }
  if (o.backward && ref_loss.defined()) {
    try {
      ref_loss.backward();
      loss.backward();
    } catch (const c10::Error& e) {
      ADD_FAILURE() << label << ": backward threw: " << e.what_without_backtrace();
      return false;
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!rg[i]) continue;
      const at::Tensor& rgd = plain[i].grad();
      const at::Tensor& dg = dist[i].grad();
      if (!rgd.defined() && !dg.defined()) continue;
      if (rgd.defined() != dg.defined()) {
        ADD_FAILURE() << label << ": gradient of input " << i << " defined only on "
                      << (rgd.defined() ? "one device" : "DTensors");
        ok = false;
        continue;
      }
      // A DTensor leaf's gradient is a DTensor on the leaf's mesh, as in PyTorch: optimizers,
      // clipping and FSDP read its placements.
      if (auto m = grad_on_leaf_mesh(dg, dist[i]); !m) {
        ADD_FAILURE() << label << ": gradient of input " << i << ": " << m.message();
        ok = false;
      }
      at::Tensor full = is_dtensor(dg) ? full_tensor(dg) : dg;
      auto r = tensors_close(full, rgd, o.rtol, o.atol);
      if (!r) {
        ADD_FAILURE() << label << ": gradient of input " << i << " differs: " << r.message();
        ok = false;
      }
      if (auto l = same_layout(dg, rgd); o.layout && !l) {
        ADD_FAILURE() << label << ": gradient of input " << i << " layout: " << l.message();
        ok = false;
      }
    }
  }
  return ok;
}

std::vector<Placements> placements_1d(int64_t ndim, bool with_partial) {
  std::vector<Placements> out{{Replicate()}};
  for (int64_t d = 0; d < ndim; ++d) out.push_back({Shard(d)});
  if (with_partial) out.push_back({Partial()});
  return out;
}

std::vector<std::vector<Placements>> combinations(const std::vector<std::vector<Placements>>& per) {
  std::vector<std::vector<Placements>> out{{}};
  for (const auto& choices : per) {
    std::vector<std::vector<Placements>> next;
    for (const auto& prefix : out) {
      for (const auto& c : choices) {
        auto v = prefix;
        v.push_back(c);
        next.push_back(std::move(v));
      }
    }
    out = std::move(next);
  }
  return out;
}

void SweepCounter::expect_cases(int64_t expected, int rank, const std::string& what) const {
  EXPECT_EQ(cases, expected) << what << ": the sweep compared another number of cases than its "
                             << "loops define";
  if (rank == 0)
    std::printf("[sweep] %s: %ld (op, case) combinations\n", what.c_str(), (long)cases);
}

}  // namespace dtensor::testing
