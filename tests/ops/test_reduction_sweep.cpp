// Property sweep: every reduction with a sharding rule, on every layout of small tensors whose
// dims split unevenly or leave empty shards (2x2 mesh, 1-D meshes of 3 and 4 ranks), must give
// full_tensor(op(dtensor)) == op(full tensor) with the same sizes, and the same input gradient,
// a DTensor on the input's mesh. Views get the same check.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <sstream>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/op_check.h"

using namespace dtensor;
using dtensor::testing::grad_on_leaf_mesh;
using dtensor::testing::run_ranks;
using dtensor::testing::tensors_close;

namespace {

using Fn = std::function<std::vector<at::Tensor>(const at::Tensor&)>;

struct Case {
  std::string name;
  Fn fn;
  bool on_bool = false;  // takes a bool tensor (any/all)
  // Gradients compared too. prod's backward finds zeros with nonzero(), a data-dependent op
  // that has no sharding rule, so prod is checked forward only.
  bool backward = true;
};

std::vector<at::Tensor> one(at::Tensor t) { return {std::move(t)}; }

// Reductions over every dim choice (none = all, each dim, all dims listed) and keepdim.
std::vector<Case> reduction_cases(int64_t ndim) {
  std::vector<Case> cs;
  auto add = [&](std::string n, Fn f, bool on_bool = false) {
    cs.push_back({std::move(n), std::move(f), on_bool});
  };
  auto add_forward_only = [&](std::string n, Fn f) {
    cs.push_back({std::move(n), std::move(f), false, false});
  };
  add("sum", [](auto& a) { return one(a.sum()); });
  add("mean", [](auto& a) { return one(a.mean()); });
  add("max", [](auto& a) { return one(a.max()); });
  add("min", [](auto& a) { return one(a.min()); });
  add_forward_only("prod", [](auto& a) { return one(a.prod()); });
  add("argmax", [](auto& a) { return one(a.argmax()); });
  add("argmin", [](auto& a) { return one(a.argmin()); });
  add("norm2", [](auto& a) { return one(at::linalg_vector_norm(a, 2)); });
  add("norm_inf", [](auto& a) { return one(at::linalg_vector_norm(a, INFINITY)); });
  add(
      "any", [](auto& a) { return one(a.any()); }, true);
  add(
      "all", [](auto& a) { return one(a.all()); }, true);
  std::vector<std::vector<int64_t>> dim_sets;
  for (int64_t d = 0; d < ndim; ++d) dim_sets.push_back({d});
  if (ndim > 1) dim_sets.push_back({0, -1});
  for (bool k : {false, true}) {
    const std::string ks = k ? ",keep" : "";
    for (const auto& ds : dim_sets) {
      std::ostringstream dn;
      for (auto d : ds) dn << d << ' ';
      const std::string s = "(" + dn.str() + ks + ")";
      add("sum" + s, [ds, k](auto& a) { return one(a.sum(ds, k)); });
      add("mean" + s, [ds, k](auto& a) { return one(a.mean(ds, k)); });
      add("amax" + s, [ds, k](auto& a) { return one(a.amax(ds, k)); });
      add("amin" + s, [ds, k](auto& a) { return one(a.amin(ds, k)); });
      add("norm1" + s, [ds, k](auto& a) { return one(at::linalg_vector_norm(a, 1, ds, k)); });
      add("norm_inf" + s,
          [ds, k](auto& a) { return one(at::linalg_vector_norm(a, INFINITY, ds, k)); });
      if (ds.size() != 1) continue;
      const int64_t d = ds[0];
      add("max.dim" + s, [d, k](auto& a) {
        auto [v, i] = at::max(a, d, k);
        return std::vector<at::Tensor>{v, i};
      });
      add("min.dim" + s, [d, k](auto& a) {
        auto [v, i] = at::min(a, d, k);
        return std::vector<at::Tensor>{v, i};
      });
      if (!k) {  // ops along a dim (no keepdim)
        add("sort" + s, [d](auto& a) {
          auto [v, i] = a.sort(d, true);
          return std::vector<at::Tensor>{v, i};
        });
        add("topk1" + s, [d](auto& a) {
          auto [v, i] = a.topk(1, d);
          return std::vector<at::Tensor>{v, i};
        });
        add("cumsum" + s, [d](auto& a) { return one(a.cumsum(d)); });
      }
      add("argmax" + s, [d, k](auto& a) { return one(a.argmax(d, k)); });
      add("argmin" + s, [d, k](auto& a) { return one(a.argmin(d, k)); });
      add(
          "any" + s, [d, k](auto& a) { return one(a.any(d, k)); }, true);
      add(
          "all" + s, [d, k](auto& a) { return one(a.all(d, k)); }, true);
    }
  }
  return cs;
}

// Every placement combination on `mesh` for an ndim tensor: R, S(d) and optionally Partials.
std::vector<Placements> layouts(const DeviceMesh& mesh, int64_t ndim, bool partial) {
  std::vector<Placement> choices{Replicate()};
  for (int64_t d = 0; d < ndim; ++d) choices.push_back(Shard(d));
  if (partial) {
    choices.push_back(Partial(ReduceOp::Sum));
    choices.push_back(Partial(ReduceOp::Avg));
  }
  std::vector<Placements> out{{}};
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    std::vector<Placements> next;
    for (const auto& p : out) {
      for (const auto& c : choices) {
        Placements q = p;
        q.push_back(c);
        next.push_back(q);
      }
    }
    out = std::move(next);
  }
  return out;
}

std::string str(const Placements& p) {
  std::string s = "(";
  for (const auto& x : p) s += x.str() + ",";
  return s + ")";
}

// `g` laid out as `p`: shards of g; a Partial(sum) holds g / (number of partial ranks) per rank
// and a Partial(avg) holds g itself.
at::Tensor lay_out(const at::Tensor& g, const DeviceMesh& mesh, const Placements& p) {
  double parts = 1;
  bool partial = false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i].is_partial() && p[i].reduce_op() == ReduceOp::Sum)
      parts *= static_cast<double>(mesh.size(static_cast<int64_t>(i)));
    partial |= p[i].is_partial();
  }
  if (!partial) return distribute_tensor(g, mesh, p, std::nullopt);
  at::Tensor local = local_tensor(distribute_tensor(g, mesh, clear_partial(p), std::nullopt));
  return from_local(local / parts, mesh, p,
                    {.shape = g.sizes().vec(), .stride = g.strides().vec()});
}

struct Tally {
  int64_t cases = 0, mismatches = 0;
};

// The gradient of sum_k <out_k, w_k> (fixed random w_k) with respect to `leaf`, for every
// floating output; undefined when no output is differentiable.
at::Tensor grad_of(const std::vector<at::Tensor>& outs, const at::Tensor& leaf) {
  at::Generator gen = at::detail::createCPUGenerator(77);
  at::Tensor loss;
  for (const auto& o : outs) {
    if (!o.is_floating_point() || !o.requires_grad()) continue;
    at::Tensor w = at::randn(o.sizes(), gen, at::kDouble);
    if (is_dtensor(o)) {
      w = distribute_tensor(w, device_mesh(o), replicate_all(device_mesh(o).ndim()), std::nullopt);
    }
    at::Tensor term = (o * w).sum();
    loss = loss.defined() ? loss + term : term;
  }
  if (!loss.defined()) return {};
  loss.backward();
  return leaf.grad();
}

// Runs `c` on `g` laid out as `p` and on `g`; records a failure on any difference of the
// outputs or, for floating inputs, of the input gradients (which must be DTensors on the
// input's mesh, as in PyTorch).
void check(const Case& c, const at::Tensor& g, const at::Tensor& dt, const std::string& where,
           Tally& tally) {
  ++tally.cases;
  const bool grad = c.backward && g.is_floating_point();
  const at::Tensor gl = grad ? g.detach().clone().requires_grad_(true) : g;
  const at::Tensor dl = grad ? dt.detach().requires_grad_(true) : dt;
  std::vector<at::Tensor> ref, out;
  try {
    ref = c.fn(gl);
  } catch (const c10::Error&) {
    --tally.cases;  // not defined on one device either (e.g. max of an empty dim)
    return;
  }
  try {
    out = c.fn(dl);
  } catch (const c10::Error& e) {
    ++tally.mismatches;
    ADD_FAILURE() << c.name << " " << where << " threw: " << e.what_without_backtrace();
    return;
  }
  for (size_t k = 0; k < ref.size(); ++k) {
    if (out[k].sizes() != ref[k].sizes()) {
      ++tally.mismatches;
      ADD_FAILURE() << c.name << " " << where << ": output " << k << " sizes " << out[k].sizes()
                    << ", expected " << ref[k].sizes();
      return;
    }
    at::Tensor full;
    try {
      full = full_tensor(out[k]);
    } catch (const c10::Error& e) {
      ++tally.mismatches;
      ADD_FAILURE() << c.name << " " << where << ": full_tensor of output " << k
                    << " threw: " << e.what_without_backtrace();
      return;
    }
    auto r = tensors_close(full.detach(), ref[k].detach(), 1e-10, 1e-10);
    if (!r) {
      ++tally.mismatches;
      ADD_FAILURE() << c.name << " " << where << ": output " << k << ": " << r.message();
      return;
    }
  }
  if (!grad) return;
  at::Tensor rg, dg;
  try {
    rg = grad_of(ref, gl);
    dg = grad_of(out, dl);
  } catch (const c10::Error& e) {
    ++tally.mismatches;
    ADD_FAILURE() << c.name << " " << where << ": backward threw: " << e.what_without_backtrace();
    return;
  }
  if (rg.defined() != dg.defined()) {
    ++tally.mismatches;
    ADD_FAILURE() << c.name << " " << where << ": gradient defined only on "
                  << (rg.defined() ? "one device" : "DTensors");
    return;
  }
  if (!rg.defined()) return;
  if (auto m = grad_on_leaf_mesh(dg, dl); !m) {
    ++tally.mismatches;
    ADD_FAILURE() << c.name << " " << where << ": gradient: " << m.message();
    return;
  }
  auto r = tensors_close(full_tensor(dg), rg, 1e-10, 1e-10);
  if (!r) {
    ++tally.mismatches;
    ADD_FAILURE() << c.name << " " << where << ": gradient: " << r.message();
  }
}

void sweep_reductions(const DeviceMesh& mesh, const std::vector<std::vector<int64_t>>& shapes,
                      Tally& tally) {
  at::manual_seed(11);
  for (const auto& shape : shapes) {
    const auto cases = reduction_cases(static_cast<int64_t>(shape.size()));
    auto g = at::randn(shape, at::kDouble);
    auto b = g > 0.3;
    for (const auto& p : layouts(mesh, static_cast<int64_t>(shape.size()), true)) {
      bool partial = false;
      for (const auto& x : p) partial |= x.is_partial();
      auto dg = lay_out(g, mesh, p);
      at::Tensor db;
      if (!partial) db = distribute_tensor(b, mesh, p, std::nullopt);
      std::ostringstream where;
      where << "on " << c10::IntArrayRef(shape) << " " << str(p);
      for (const auto& c : cases) {
        if (c.on_bool && partial) continue;
        check(c, c.on_bool ? b : g, c.on_bool ? db : dg, where.str(), tally);
      }
    }
  }
}

// View ops on every dim of `shape`: results must match one device in values and sizes.
std::vector<Case> view_cases(const std::vector<int64_t>& shape) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  std::vector<Case> cs;
  auto add = [&](std::string n, Fn f) { cs.push_back({std::move(n), std::move(f), false}); };
  add("view(-1)", [](auto& a) { return one(a.view({-1})); });
  add("flatten", [](auto& a) { return one(a.flatten()); });
  add("unsqueeze(0)", [](auto& a) { return one(a.unsqueeze(0)); });
  add("unsqueeze(-1)", [](auto& a) { return one(a.unsqueeze(-1)); });
  add("expand", [](auto& a) {
    std::vector<int64_t> sz{3};
    for (auto s : a.sizes()) sz.push_back(s);
    return one(a.unsqueeze(0).expand(sz));
  });
  if (nd > 1) {
    std::vector<int64_t> rev(shape.rbegin(), shape.rend());
    add("reshape(reversed)", [rev](auto& a) { return one(a.reshape(rev)); });
    add("transpose(0,1)", [](auto& a) { return one(a.transpose(0, 1)); });
    add("permute(1,0)", [](auto& a) { return one(a.permute({1, 0})); });
  }
  for (int64_t d = 0; d < nd; ++d) {
    const std::string ds = std::to_string(d);
    const int64_t n = shape[d];
    add("select(" + ds + ",0)", [d](auto& a) { return one(a.select(d, 0)); });
    add("select(" + ds + ",-1)", [d](auto& a) { return one(a.select(d, -1)); });
    add("slice(" + ds + ",1:)", [d, n](auto& a) { return one(a.slice(d, 1, n)); });
    add("slice(" + ds + ",::2)", [d, n](auto& a) { return one(a.slice(d, 0, n, 2)); });
    add("narrow(" + ds + ",0,1)", [d](auto& a) { return one(a.narrow(d, 0, 1)); });
  }
  return cs;
}

// squeeze() and squeeze(d) on every dim: a shard whose local size is 1 must not be squeezed.
std::vector<Case> squeeze_cases(const std::vector<int64_t>& shape) {
  std::vector<Case> cs{{"squeeze", [](auto& a) { return one(a.squeeze()); }}};
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    cs.push_back(
        {"squeeze(" + std::to_string(d) + ")", [d](auto& a) { return one(a.squeeze(d)); }});
  }
  return cs;
}

void sweep_views(
    const DeviceMesh& mesh, const std::vector<std::vector<int64_t>>& shapes, Tally& tally,
    const std::function<std::vector<Case>(const std::vector<int64_t>&)>& make_cases = view_cases) {
  at::manual_seed(12);
  for (const auto& shape : shapes) {
    const auto cases = make_cases(shape);
    auto g = at::randn(shape, at::kDouble);
    for (const auto& p : layouts(mesh, static_cast<int64_t>(shape.size()), true)) {
      auto dg = lay_out(g, mesh, p);
      std::ostringstream where;
      where << "on " << c10::IntArrayRef(shape) << " " << str(p);
      for (const auto& c : cases) check(c, g, dg, where.str(), tally);
    }
  }
}

// Runs `sweep` on a fresh mesh of `shape` over forked ranks; expects, on every rank, exactly
// `expected_cases` compared cases (worked out from the case and layout lists, so a generator
// that yields fewer fails) and no mismatch.
void run_sweep(const std::vector<int64_t>& shape, const std::string& label, int64_t expected_cases,
               const std::function<void(const DeviceMesh&, Tally&)>& sweep) {
  int64_t world = 1;
  for (auto s : shape) world *= s;
  run_ranks(static_cast<int>(world), [&](int rank) {
    auto mesh = init_device_mesh("cpu", shape);
    Tally t;
    sweep(mesh, t);
    if (rank == 0) std::printf("%s: %lld cases\n", label.c_str(), (long long)t.cases);
    EXPECT_EQ(t.cases, expected_cases) << label;
    EXPECT_EQ(t.mismatches, 0);
  });
}

}  // namespace

// Case counts: reduction_cases gives 77 cases for 2 dims (10 of them on bool) and 38 for 1 dim
// (6 on bool); the bool ones skip Partial layouts. layouts() offers R, S(d) per dim and two
// Partials on each mesh dim: 25 layouts of a 2-D tensor on a 2x2 mesh (16 with a Partial), 16 of
// a 1-D one (12), and on a 1-D mesh 5 (2) and 4 (2).
// view_cases gives 18 cases for 2 dims and 10 for 1 dim, squeeze_cases ndim + 1.
TEST(ReductionSweep, TwoByTwoMeshUnevenAndEmptyShards) {
  // 5 -> 3,2 -> 2,1,1,1; 2 -> 1,0,1,0; 6 -> 2,1,2,1; 1 -> 1,0,0,0
  constexpr int64_t k2d = 9 * 77 + 16 * 67, k1d = 4 * 38 + 12 * 32;
  run_sweep({2, 2}, "reduction sweep 2x2", 2 * k2d + k1d, [](const DeviceMesh& m, Tally& t) {
    sweep_reductions(m, {{5, 2}, {1, 6}, {3}}, t);
  });
}

TEST(ReductionSweep, OneDimMeshesOfThreeAndFourRanks) {
  for (int64_t world : {3, 4}) {
    constexpr int64_t k2d = 3 * 77 + 2 * 67, k1d = 2 * 38 + 2 * 32;
    run_sweep({world}, "reduction sweep 1-D x" + std::to_string(world), 2 * k2d + k1d,
              [](const DeviceMesh& m, Tally& t) {
                sweep_reductions(m, {{5, 2}, {1, 3}, {6}}, t);
              });
  }
}

TEST(ViewSweep, TwoByTwoAndOneDimMeshesUnevenAndEmptyShards) {
  run_sweep({2, 2}, "view sweep 2x2", 2 * 25 * 18 + 16 * 10, [](const DeviceMesh& m, Tally& t) {
    sweep_views(m, {{5, 2}, {1, 6}, {3}}, t);
  });
  run_sweep({3}, "view sweep 1-D x3", 2 * 5 * 18 + 4 * 10, [](const DeviceMesh& m, Tally& t) {
    sweep_views(m, {{5, 2}, {1, 6}, {4}}, t);
  });
}

// squeeze() / squeeze(1) of [5, 2] laid out (R, S(1)) once squeezed local shards of size 1
// (the spec and the local tensor then disagreed); only dims of global size 1 go.
TEST(ViewSweep, SqueezeOfShardsWithLocalSizeOneMatchesOneDevice) {
  run_sweep({2, 2}, "squeeze sweep 2x2", 2 * 25 * 3 + 16 * 2, [](const DeviceMesh& m, Tally& t) {
    sweep_views(m, {{5, 2}, {1, 6}, {3}}, t, squeeze_cases);
  });
}
