// Sweep: tensor-manipulation and indexing ops over shapes x placements x world sizes against one
// device (forward and every input gradient), plus rotary embeddings, GQA head repetition, the
// collectives of key cases, and equal() agreement.
#include <ATen/ATen.h>
#include <ATen/TensorIndexing.h>
#include <gtest/gtest.h>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/op_check.h"

using namespace dtensor;
using namespace dtensor::testing;
using at::indexing::None;
using at::indexing::Slice;

namespace {

using Choices = std::vector<Placements>;

// One op applied to fixed inputs, with the placements each input is tried with.
struct Case {
  std::string name;
  std::vector<at::Tensor> inputs;
  OpFn fn;
  std::vector<Choices> choices;  // per input
  // Treat plain tensors as Replicate (some backward formulas create global-size plain zeros).
  bool implicit_replication = false;
};

std::vector<at::Tensor> one(const at::Tensor& t) { return {t}; }

// Float inputs: R, every shard and Partial. Index inputs: R and every shard.
Choices float_choices(const at::Tensor& t) { return placements_1d(t.dim(), true); }
Choices index_choices(const at::Tensor& t) { return placements_1d(t.dim(), false); }

Case unary(std::string name, const at::Tensor& a,
           std::function<std::vector<at::Tensor>(const at::Tensor&)> f) {
  return Case{std::move(name),
              {a},
              [f](const std::vector<at::Tensor>& x) { return f(x[0]); },
              {float_choices(a)}};
}

void run_cases(const DeviceMesh& mesh, const std::vector<Case>& cases, SweepCounter& n) {
  for (const auto& c : cases) {
    for (const auto& pl : combinations(c.choices)) {
      std::string label = c.name;
      for (size_t i = 0; i < pl.size(); ++i) label += (i ? "x" : " ") + to_string(pl[i]);
      for (const auto& t : c.inputs) label += " " + c10::str(t.sizes());
      std::optional<ImplicitReplication> guard;
      if (c.implicit_replication) guard.emplace();
      n.add(check_op(mesh, label, c.fn, c.inputs, pl));
    }
  }
}

at::Tensor randn(std::vector<int64_t> shape) { return at::randn(shape, at::kDouble); }
at::Tensor longs(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }
// Tensor?[] indices (nullopt: a whole dim).
c10::List<std::optional<at::Tensor>> ix(std::initializer_list<std::optional<at::Tensor>> l) {
  c10::List<std::optional<at::Tensor>> out;
  for (const auto& t : l) out.push_back(t);
  return out;
}

std::vector<Case> manipulation_cases(const std::vector<int64_t>& shape) {
  const auto a = randn(shape);
  const int64_t r = shape[0], c = shape[1];
  const auto b = randn({r, c + 2});
  const auto same = randn(shape);
  const auto empty = at::empty({0}, at::kDouble);
  const auto pairs = randn({r, c, 2});
  std::vector<Case> cases;
  auto two = [](std::string name, const at::Tensor& x, const at::Tensor& y,
                std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> f) {
    return Case{std::move(name),
                {x, y},
                [f](const std::vector<at::Tensor>& v) { return one(f(v[0], v[1])); },
                {float_choices(x), float_choices(y)}};
  };
  cases.push_back(two("cat_dim1", a, b, [](auto& x, auto& y) { return at::cat({x, y}, 1); }));
  cases.push_back(two("cat_dim0", a, same, [](auto& x, auto& y) { return at::cat({x, y, x}, 0); }));
  cases.push_back(
      Case{"cat_with_empty",
           {a, empty, same},
           [](const std::vector<at::Tensor>& v) {
             return one(at::cat({v[0], v[1], v[2]}, -1));
           },
           {float_choices(a), {{Replicate()}, {Shard(0)}}, {{Replicate()}, {Shard(0)}}}});
  cases.push_back(two("stack_dim0", a, same, [](auto& x, auto& y) {
    return at::stack({x, y}, 0);
  }));
  cases.push_back(two("stack_dim1", a, same, [](auto& x, auto& y) {
    return at::stack({x, y}, 1);
  }));
  cases.push_back(two("stack_last", a, same, [](auto& x, auto& y) {
    return at::stack({x, y}, -1);
  }));
  const auto cols = randn({r, 2}), col = randn({r});
  cases.push_back(two("slice_scatter", a, cols,
                      [](auto& x, auto& y) { return at::slice_scatter(x, y, 1, 1, 3); }));
  cases.back().implicit_replication = true;  // its backward makes at::zeros(src.sizes())
  cases.push_back(two("select_scatter", a, col,
                      [](auto& x, auto& y) { return at::select_scatter(x, y, 1, -1); }));
  cases.back().implicit_replication = true;  // its backward makes at::zeros(src.sizes())
  cases.push_back(unary("split_dim1", a, [](auto& x) { return x.split(2, 1); }));
  cases.push_back(unary("split_dim0", a, [](auto& x) { return x.split(3, 0); }));
  cases.push_back(unary("split_with_sizes", a, [c](auto& x) {
    return x.split_with_sizes({1, c - 1}, 1);
  }));
  cases.push_back(unary("unbind0", a, [](auto& x) { return x.unbind(0); }));
  cases.push_back(unary("unbind1", a, [](auto& x) { return x.unbind(1); }));
  cases.push_back(unary("chunk", a, [](auto& x) { return x.chunk(2, 1); }));
  cases.push_back(unary("slice", a, [](auto& x) { return one(x.slice(1, 1, 3)); }));
  cases.push_back(unary("slice_negative", a, [](auto& x) { return one(x.slice(0, -2)); }));
  cases.push_back(unary("slice_step", a, [](auto& x) { return one(x.slice(1, 0, INT64_MAX, 2)); }));
  cases.push_back(
      unary("slice_whole", a, [](auto& x) { return one(x.slice(0, 0, INT64_MAX) * 2); }));
  cases.push_back(unary("narrow", a, [](auto& x) { return one(x.narrow(0, 1, 2)); }));
  cases.push_back(unary("index_slices", a, [](auto& x) {
    return one(x.index({Slice(1, None), Slice(None, -1)}));
  }));
  cases.push_back(unary("select_last", a, [](auto& x) { return one(x.select(1, -1)); }));
  cases.push_back(unary("select_first", a, [](auto& x) { return one(x.select(0, 0)); }));
  cases.push_back(unary("repeat", a, [](auto& x) { return one(x.repeat({2, 1})); }));
  cases.push_back(unary("repeat_new_dim", a, [](auto& x) { return one(x.repeat({2, 1, 3})); }));
  cases.push_back(unary("roll0", a, [](auto& x) { return one(x.roll(1, 0)); }));
  cases.push_back(unary("roll_both", a, [](auto& x) { return one(x.roll({1, -2}, {0, 1})); }));
  cases.push_back(unary("roll_flat", a, [](auto& x) { return one(x.roll(3)); }));
  cases.push_back(unary("flip0", a, [](auto& x) { return one(x.flip({0})); }));
  cases.push_back(unary("flip_last", a, [](auto& x) { return one(x.flip({-1})); }));
  cases.push_back(unary("triu", a, [](auto& x) { return one(x.triu(1)); }));
  cases.push_back(unary("tril", a, [](auto& x) { return one(x.tril(-1)); }));
  cases.push_back(unary("pad_last", a, [](auto& x) {
    return one(at::constant_pad_nd(x, {1, 2}, 0.5));
  }));
  cases.push_back(unary("pad_first", a, [](auto& x) {
    return one(at::constant_pad_nd(x, {0, 0, 2, 1}));
  }));
  cases.push_back(unary("view_as_complex_real", pairs, [](auto& x) {
    return one(at::view_as_real(at::view_as_complex(x) * c10::complex<double>(0.5, -2.0)));
  }));
  return cases;
}

std::vector<Case> indexing_cases(const std::vector<int64_t>& shape) {
  const int64_t r = shape[0], c = shape[1];
  const auto a = randn(shape);
  const auto idx = longs({r - 1, 0, 1, r - 1, 0});  // repeats: accumulates
  const auto cidx = longs({c - 1, 0, 1, 0});
  const auto uniq = longs({r - 1, 0});
  const auto idx2d = at::randint(0, r, {2, 3}, at::kLong);
  const auto row = at::randint(0, r, {3, 1}, at::kLong);  // broadcast with col
  const auto col = at::randint(0, c, {4}, at::kLong);
  const auto gi = at::randint(0, c, {r, 2}, at::kLong);   // gather along dim 1
  const auto gi0 = at::randint(0, r, {3, c}, at::kLong);  // gather along dim 0
  const auto si =
      at::stack({at::randperm(c, at::kLong).slice(0, 0, 2)}, 0).expand({r, 2}).contiguous();
  const auto src = randn({r, 2});
  const auto vals = randn({5, c});
  const auto uvals = randn({2, c});
  const auto a3 = randn({r, 3, c});
  const auto i3 = at::randint(0, r, {4}, at::kLong), j3 = at::randint(0, c, {4}, at::kLong);
  std::vector<Case> cases;
  auto fi = [](const at::Tensor& t) { return float_choices(t); };
  auto ii = [](const at::Tensor& t) { return index_choices(t); };
  auto mk = [](std::string name, std::vector<at::Tensor> in, std::vector<Choices> ch,
               std::function<at::Tensor(const std::vector<at::Tensor>&)> f) {
    return Case{std::move(name), std::move(in),
                [f](const std::vector<at::Tensor>& v) { return one(f(v)); }, std::move(ch)};
  };
  cases.push_back(mk("index_rows", {a, idx}, {fi(a), ii(idx)},
                     [](auto& v) { return at::index(v[0], ix({v[1]})); }));
  cases.push_back(mk("index_cols", {a, cidx}, {fi(a), ii(cidx)}, [](auto& v) {
    return at::index(v[0], ix({std::nullopt, v[1]}));
  }));
  cases.push_back(mk("index_2d", {a, idx2d}, {fi(a), ii(idx2d)},
                     [](auto& v) { return at::index(v[0], ix({v[1]})); }));
  cases.push_back(mk("index_broadcast", {a, row, col}, {fi(a), ii(row), ii(col)}, [](auto& v) {
    return at::index(v[0], ix({v[1], v[2]}));
  }));
  cases.push_back(mk("index_apart", {a3, i3, j3}, {fi(a3), ii(i3), ii(j3)}, [](auto& v) {
    return at::index(v[0], ix({v[1], std::nullopt, v[2]}));
  }));
  cases.push_back(mk("index_select0", {a, idx}, {fi(a), ii(idx)},
                     [](auto& v) { return v[0].index_select(0, v[1]); }));
  cases.push_back(mk("index_select1", {a, cidx}, {fi(a), ii(cidx)},
                     [](auto& v) { return v[0].index_select(1, v[1]); }));
  cases.push_back(
      mk("gather1", {a, gi}, {fi(a), ii(gi)}, [](auto& v) { return v[0].gather(1, v[1]); }));
  cases.push_back(
      mk("gather0", {a, gi0}, {fi(a), ii(gi0)}, [](auto& v) { return v[0].gather(0, v[1]); }));
  cases.push_back(mk("scatter_src", {a, si, src}, {fi(a), ii(si), fi(src)},
                     [](auto& v) { return v[0].scatter(1, v[1], v[2]); }));
  cases.push_back(mk("scatter_value", {a, si}, {fi(a), ii(si)},
                     [](auto& v) { return v[0].scatter(1, v[1], 2.5); }));
  cases.push_back(mk("scatter_add", {a, gi, src}, {fi(a), ii(gi), fi(src)},
                     [](auto& v) { return v[0].scatter_add(1, v[1], v[2]); }));
  cases.push_back(mk("index_put", {a, uniq, uvals}, {fi(a), ii(uniq), fi(uvals)},
                     [](auto& v) { return at::index_put(v[0], ix({v[1]}), v[2]); }));
  cases.back().implicit_replication = true;  // its backward makes at::zeros(values.sizes())
  cases.push_back(mk("index_put_accumulate", {a, idx, vals}, {fi(a), ii(idx), fi(vals)},
                     [](auto& v) { return at::index_put(v[0], ix({v[1]}), v[2], true); }));
  cases.push_back(mk("index_put_cols_bcast", {a, cidx}, {fi(a), ii(cidx)}, [](auto& v) {
    return at::index_put(v[0], ix({std::nullopt, v[1]}), at::scalar_tensor(1.5, at::kDouble), true);
  }));
  cases.push_back(mk("index_add", {a, idx, vals}, {fi(a), ii(idx), fi(vals)},
                     [](auto& v) { return v[0].index_add(0, v[1], v[2], 0.5); }));
  return cases;
}

void sweep(const char* what,
           const std::function<std::vector<Case>(const std::vector<int64_t>&)>& make,
           const std::vector<std::vector<int64_t>>& shapes, int64_t expected_cases) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      for (const auto& s : shapes) run_cases(mesh, make(s), n);
      n.expect_cases(expected_cases, rank, c10::str(what, ", world ", world));
    });
  }
}

}  // namespace

TEST(IndexOpsSweep, ManipulationOpsMatchOneDevice) {
  // Per shape, with 4 layouts of a 2-D float tensor, 3 of a 1-D one: 5 two-input cases x 4 x 4,
  // slice_scatter 4 x 4, select_scatter 4 x 3, cat_with_empty 4 x 2 x 2, 25 unary cases x 4,
  // and view_as_complex_real on a 3-D tensor x 5.
  constexpr int64_t per_shape = 5 * 16 + 16 + 12 + 16 + 25 * 4 + 5;
  sweep("cat/stack/split/slice/select/repeat/roll/flip/tri/pad/complex", manipulation_cases,
        {{4, 6}, {5, 3}}, 2 * per_shape);
}

TEST(IndexOpsSweep, IndexingOpsMatchOneDevice) {
  // Per shape (float 2-D: 4 layouts, 3-D: 5; index 1-D: 2, 2-D: 3): index_rows, index_cols,
  // index_select0/1 and index_put_cols_bcast 4 x 2; index_2d, gather1/0, scatter_value 4 x 3;
  // index_broadcast 4 x 3 x 2; index_apart 5 x 2 x 2; scatter_src, scatter_add 4 x 3 x 4;
  // index_put, index_put_accumulate, index_add 4 x 2 x 4.
  constexpr int64_t per_shape = 5 * 8 + 4 * 12 + 24 + 20 + 2 * 48 + 3 * 32;
  sweep("index/index_select/gather/scatter/index_put/index_add", indexing_cases, {{4, 6}, {5, 3}},
        2 * per_shape);
}

// Layouts on a 2x2 mesh for a tensor of `ndim` dims (no Partial for integer tensors).
Choices mesh2d_choices(const at::Tensor& t) {
  const int64_t last = std::max<int64_t>(t.dim() - 1, 0);
  Choices c = {{Shard(0), Shard(last)},
               {Shard(last), Shard(0)},
               {Shard(0), Shard(0)},
               {Replicate(), Shard(last)},
               {Replicate(), Replicate()}};
  if (t.is_floating_point()) {
    c.push_back({Partial(), Shard(0)});
    c.push_back({Shard(last), Partial()});
  }
  return c;
}

TEST(IndexOpsSweep, TwoDimensionalMeshMatchesOneDevice) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    SweepCounter n;
    for (auto shape : std::vector<std::vector<int64_t>>{{4, 6}, {5, 3}}) {
      auto cases = manipulation_cases(shape);
      for (auto& c : indexing_cases(shape)) cases.push_back(c);
      for (const auto& c : cases) {
        // Input j takes layout (k + j) of its list: every layout of every input, few combinations.
        std::vector<Choices> lists;
        size_t most = 0;
        for (const auto& t : c.inputs) {
          lists.push_back(mesh2d_choices(t));
          most = std::max(most, lists.back().size());
        }
        for (size_t k = 0; k < most; ++k) {
          Case one_case = c;
          for (size_t j = 0; j < lists.size(); ++j)
            one_case.choices[j] = {lists[j][(k + j) % lists[j].size()]};
          run_cases(mesh, {one_case}, n);
        }
      }
    }
    // 2 shapes x (34 manipulation + 16 indexing cases) x the 7 layouts of their float input.
    n.expect_cases(2 * (34 + 16) * 7, rank, "2x2 mesh, all ops");
  });
}

// Llama-style rotary embeddings on (B, S, H, D) queries sharded by heads or by sequence.
TEST(IndexOps, RotaryEmbeddingBothWaysMatchesOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      for (auto shape : std::vector<std::vector<int64_t>>{{2, 4, 4, 6}, {1, 5, 3, 8}}) {
        const int64_t B = shape[0], S = shape[1], H = shape[2], D = shape[3];
        const auto q = randn(shape);
        const auto cos = randn({S, D}), sin = randn({S, D});
        const auto freqs = randn({S, D / 2, 2});
        // (a) q * cos + rotate_half(q) * sin
        OpFn rotate_half = [=](const std::vector<at::Tensor>& v) {
          const auto& x = v[0];
          auto rot = at::cat({-x.slice(-1, D / 2), x.slice(-1, 0, D / 2)}, -1);
          return one(x * v[1].view({1, S, 1, D}) + rot * v[2].view({1, S, 1, D}));
        };
        // (b) complex rotation: view_as_complex(q) * freqs, back with view_as_real
        OpFn complex = [=](const std::vector<at::Tensor>& v) {
          auto xc = at::view_as_complex(v[0].reshape({B, S, H, D / 2, 2}));
          auto fc = at::view_as_complex(v[1]).view({1, S, 1, D / 2});
          return one(at::view_as_real(xc * fc).flatten(3));
        };
        const Choices qp = {{Replicate()}, {Shard(2)}, {Shard(1)}, {Partial()}};
        const Choices tp = {{Replicate()}, {Shard(0)}};
        for (const auto& pl : combinations({qp, tp, tp})) {
          n.add(check_op(mesh,
                         "rotate_half " + to_string(pl[0]) + to_string(pl[1]) + c10::str(q.sizes()),
                         rotate_half, {q, cos, sin}, pl));
        }
        // Frequencies stay replicated and without gradient here: complex tensors cannot go
        // through a Gloo collective yet, and reshaping a seq-sharded complex tensor with an
        // uneven S (or its gradient) gathers it.
        for (const auto& pl : combinations({qp, {{Replicate()}}})) {
          n.add(check_op(mesh,
                         "complex " + to_string(pl[0]) + to_string(pl[1]) + c10::str(q.sizes()),
                         complex, {q, freqs}, pl, {.requires_grad = {true, false}}));
        }
      }
      // 2 shapes x (4 x 2 x 2 rotate_half layouts + 4 complex ones).
      n.expect_cases(2 * (4 * 2 * 2 + 4), rank, c10::str("rotary embeddings, world ", world));
      // Heads sharding with replicated frequencies needs no communication at all.
      const auto q = distribute_tensor(randn({2, 4, 4, 6}), mesh, {Shard(2)});
      const auto freqs = distribute_tensor(randn({4, 3, 2}), mesh, {Replicate()});
      CommDebugMode comm;
      auto out = at::view_as_real(at::view_as_complex(q.reshape({2, 4, 4, 3, 2})) *
                                  at::view_as_complex(freqs).view({1, 4, 1, 3}))
                     .flatten(3);
      EXPECT_EQ(placements(out)[0], Shard(2));
      if (world != 3) {
        EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
      }
    });
  }
}

// Grouped-query attention repeats each key/value head n_rep times; with heads sharded and each
// rank holding whole head groups, it stays local.
TEST(IndexOps, GqaHeadRepetitionMatchesOneDeviceAndStaysLocal) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      SweepCounter n;
      const int64_t n_rep = 3;
      for (auto shape : std::vector<std::vector<int64_t>>{{2, 3, 4, 2}, {1, 2, 3, 4}}) {
        const auto k = randn(shape);
        const int64_t B = shape[0], S = shape[1], KV = shape[2], D = shape[3];
        OpFn interleave = [](const std::vector<at::Tensor>& v) {
          return one(v[0].repeat_interleave(n_rep, 2));
        };
        OpFn expand = [=](const std::vector<at::Tensor>& v) {
          return one(v[0].index({Slice(), Slice(), Slice(), None, Slice()})
                         .expand({B, S, KV, n_rep, D})
                         .reshape({B, S, KV * n_rep, D}));
        };
        for (const auto& p : placements_1d(4, true)) {
          n.add(check_op(mesh, "repeat_interleave " + to_string(p) + c10::str(k.sizes()),
                         interleave, {k}, {p}));
          n.add(check_op(mesh, "expand_reshape " + to_string(p) + c10::str(k.sizes()), expand, {k},
                         {p}));
        }
      }
      // 2 shapes x 6 layouts x 2 ways.
      n.expect_cases(2 * 6 * 2, rank, c10::str("GQA head repetition, world ", world));
      // (A 1-rank mesh is left out: pointwise ties between S and R follow the first operand.)
      if (world > 1 && 4 % world == 0) {
        auto k = distribute_tensor(randn({2, 3, 4, 2}).requires_grad_(true), mesh, {Shard(2)});
        CommDebugMode comm;
        auto rep = k.repeat_interleave(n_rep, 2);
        EXPECT_EQ(placements(rep)[0], Shard(2));
        (rep * rep).sum().backward();  // a sharded gradient (that of sum() alone is replicated)
        EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
        EXPECT_EQ(placements(k.grad())[0], Shard(2));
      }
    });
  }
}

// Lookups with sharded ids stay local; accumulating them (out of place) gives a Partial sum
// instead of gathering the ids.
TEST(IndexOps, ShardedIndicesNeedNoCommunication) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    const auto w = randn({10, 3});
    const auto ids = at::randint(0, 10, {8, 5}, at::kLong);
    const auto vals = randn({8, 5, 3});
    const auto col = ids.select(1, 0).unsqueeze(1).expand({8, 3}).contiguous();
    auto dw = distribute_tensor(w.clone().requires_grad_(true), mesh, {Replicate()});
    auto dids = distribute_tensor(ids, mesh, {Shard(0)});
    auto dcol = distribute_tensor(col, mesh, {Shard(0)});
    auto dvals = distribute_tensor(vals, mesh, {Shard(0)});
    auto rw = w.clone().requires_grad_(true);
    auto zeros = distribute_tensor(at::zeros({10, 3}, at::kDouble), mesh, {Replicate()});
    CommDebugMode comm;
    auto out = at::index(dw, ix({dids}));
    EXPECT_EQ(placements(out)[0], Shard(0));
    auto gathered = dw.gather(0, dcol);
    EXPECT_EQ(placements(gathered)[0], Shard(0));
    auto put = at::index_put(zeros, ix({dids}), dvals, true);
    EXPECT_EQ(placements(put)[0], Partial());
    auto added = zeros.scatter_add(0, dcol, dvals.select(1, 0));
    EXPECT_EQ(placements(added)[0], Partial());
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    EXPECT_TENSOR_CLOSE(full_tensor(put),
                        at::index_put(at::zeros({10, 3}, at::kDouble), ix({ids}), vals, true),
                        1e-12, 1e-12);
    EXPECT_TENSOR_CLOSE(full_tensor(added),
                        at::zeros({10, 3}, at::kDouble).scatter_add(0, col, vals.select(1, 0)),
                        1e-12, 1e-12);
    (out.sum() + gathered.sum()).backward();
    (at::index(rw, ix({ids})).sum() + rw.gather(0, col).sum()).backward();
    EXPECT_TENSOR_CLOSE(full_tensor(dw.grad()), rw.grad(), 1e-12, 1e-12);
  });
}

TEST(IndexOps, InPlaceIndexPutKeepsTheLayoutOrSaysWhy) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const auto g = randn({4, 6});
    auto x = distribute_tensor(g.clone(), mesh, {Shard(1)});
    auto ids = distribute_tensor(longs({0, 2}), mesh, {Replicate()});
    auto v = distribute_tensor(randn({2, 6}), mesh, {Replicate()});
    at::index_put_(x, ix({ids}), v, true);
    EXPECT_EQ(placements(x)[0], Shard(1));
    EXPECT_TENSOR_CLOSE(full_tensor(x), at::index_put(g, ix({longs({0, 2})}), full_tensor(v), true),
                        1e-12, 1e-12);
    auto y = distribute_tensor(g.clone(), mesh, {Shard(0)});
    EXPECT_ERROR(at::index_put_(y, ix({ids}), v), c10::Error, "in place", "S(0)");
  });
}

TEST(IndexOps, BooleanMaskIndexingSaysWhatToDoInstead) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = distribute_tensor(randn({4, 3}), mesh, {Shard(0)});
    auto mask = distribute_tensor(at::rand({4}) > 0.5, mesh, {Replicate()});
    EXPECT_ERROR(at::index(x, ix({mask})), c10::Error, "boolean mask", "masked_fill");
  });
}

TEST(IndexOps, EqualAgreesOnEveryRank) {
  for (int world : {1, 2, 3, 4}) {
    run_ranks(world, [world](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      const auto g = randn({5, 3});
      auto a = distribute_tensor(g, mesh, {Shard(0)});
      auto b = distribute_tensor(g.clone(), mesh, {Shard(0)});
      CommDebugMode comm;
      EXPECT_TRUE(a.equal(b));
      const int64_t per_compare = world > 1 ? 1 : 0;  // a 1-rank mesh has nothing to combine
      EXPECT_EQ(comm.get_total_counts(), per_compare);
      // One element differs on the last rank's shard only: every rank must say false.
      auto changed = g.clone();
      changed[4][2] += 1;
      auto c = distribute_tensor(changed, mesh, {Shard(0)});
      EXPECT_FALSE(a.equal(c));
      EXPECT_FALSE(c.equal(a));
      // Replicas compare locally; a replica against a shard is chunked, not gathered.
      auto r = distribute_tensor(g, mesh, {Replicate()});
      comm.enter();
      EXPECT_TRUE(r.equal(r.clone()));
      EXPECT_EQ(comm.get_total_counts(), 0);
      EXPECT_TRUE(r.equal(a));
      EXPECT_TRUE(a.equal(r));
      EXPECT_EQ(comm.get_total_counts(), 2 * per_compare);
      if (world > 1) {
        EXPECT_EQ(comm.get_comm_counts(), (CommCounts{{CommType::all_reduce, 2}}));
      }
      EXPECT_FALSE(r.equal(c));
      // Different shapes differ without any communication.
      auto shorter = distribute_tensor(randn({4, 3}), mesh, {Shard(0)});
      comm.enter();
      EXPECT_FALSE(a.equal(shorter));
      EXPECT_EQ(comm.get_total_counts(), 0);
      // A Partial operand is reduced first.
      auto p = from_local(local_tensor(r) / world, mesh, {Partial()});
      EXPECT_TRUE(at::allclose(full_tensor(p), g));
      EXPECT_TRUE(a.is_same_size(p));
      EXPECT_FALSE(a.is_same_size(c.slice(0, 1)));
      if (rank == 0)
        std::printf("[sweep] equal/is_same_size, world %d: 10 (op, case) combinations\n", world);
    });
  }
}
