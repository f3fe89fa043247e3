// Attention under context parallelism against one device attending within each document alone,
// in float64: outputs and the gradients of q, k and v (every rank's slots gathered back into
// sequence order), for the ring and the all-gather, one long sequence (head-tail) and packed
// documents of random lengths (balanced and head-tail splits), grouped KV heads, sliding windows
// and a score scale; the collectives of each call counted by formula; the DTensor form on a
// (cp, tp) mesh with heads sharded; and the refusals.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/mpi_job.h"

using namespace dtensor;
using namespace dtensor::testing;
using cp::RotateMethod;

namespace {

struct Case {
  std::string name;
  int64_t seq_len;
  std::vector<std::vector<int64_t>> lengths;  // per row; empty: each row one sequence
  bool balanced;                              // balanced_layout, else head_tail_layout
  int64_t q_heads, kv_heads, window;
  double scale;
};

at::Tensor ids_of(const Case& c) {
  return c.lengths.empty() ? at::Tensor() : cp::document_ids_from_lengths(c.lengths, c.seq_len);
}

// One device: each document of each row alone, plain causal attention (a sliding window w:
// query i sees keys i - w + 1 .. i). (B, S, Hq * D); 0 on tokens outside every document.
at::Tensor one_device(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const Case& c) {
  const int64_t B = q.size(0), S = q.size(1), rep = c.q_heads / c.kv_heads;
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> lengths = c.lengths.empty() ? std::vector<int64_t>{S} : c.lengths[b];
    std::vector<at::Tensor> pieces;
    int64_t start = 0;
    for (int64_t len : lengths) {
      auto take = [&](const at::Tensor& t) { return t[b].narrow(0, start, len).transpose(0, 1); };
      const at::Tensor i = at::arange(len).view({-1, 1}), j = at::arange(len).view({1, -1});
      at::Tensor mask = j <= i;
      if (c.window > 0) mask = mask & (i - j < c.window);
      const at::Tensor out = at::scaled_dot_product_attention(
          take(q), take(k).repeat_interleave(rep, 0), take(v).repeat_interleave(rep, 0), mask, 0.0,
          false, c.scale > 0 ? std::optional<double>(c.scale) : std::nullopt);
      pieces.push_back(out.transpose(0, 1).reshape({len, -1}));
      start += len;
    }
    if (start < S) pieces.push_back(at::zeros({S - start, pieces[0].size(1)}, q.options()));
    rows.push_back(at::cat(pieces));
  }
  return at::stack(rows);
}

std::vector<Case> cases() {
  std::mt19937 gen(7);
  std::uniform_int_distribution<int64_t> len(1, 23);
  auto random_row = [&](int64_t total) {
    std::vector<int64_t> row;
    for (int64_t left = total; left > 0;) {
      const int64_t l = std::min(left, len(gen));
      row.push_back(l);
      left -= l;
    }
    return row;
  };
  const std::vector<std::vector<int64_t>> packed = {random_row(61), random_row(54)};
  return {
      {"one sequence, head-tail", 37, {}, false, 4, 2, 0, 0},
      {"packed documents, balanced", 61, packed, true, 4, 2, 0, 0},
      {"packed documents, head-tail", 61, packed, false, 4, 4, 0, 0},
      {"packed documents, balanced, sliding window 5, scale 0.3", 61, packed, true, 4, 1, 5, 0.3},
      {"one sequence, head-tail, sliding window 11", 40, {}, false, 2, 2, 11, 0},
  };
}

const DeviceMesh& cp_mesh() {
  static const DeviceMesh mesh = init_device_mesh("cpu", {comm::get_world_size()}, {"cp"});
  return mesh;
}

// Rank r's part of every rank's slots, gathered and put back in sequence order.
at::Tensor gathered(const at::Tensor& local, const cp::ContextLayout& layout) {
  return layout.unshard(
      comm::all_gather_into_tensor(local.detach().contiguous(), 1, cp_mesh().group(0)));
}

CommCounts expected_counts(RotateMethod rotate, int64_t cp, bool backward) {
  if (cp == 1) return {};
  if (rotate == RotateMethod::all_gather)
    return {{backward ? CommType::reduce_scatter_tensor : CommType::all_gather_into_tensor, 2}};
  const int64_t exchanges = backward ? 2 * cp - 1 : cp - 1;
  return {{CommType::send, exchanges}, {CommType::recv, exchanges}};
}

void check_case(const Case& c) {
  SCOPED_TRACE(c.name);
  const DeviceMesh& mesh = cp_mesh();
  const int64_t cp = mesh.size(), r = mesh.get_local_rank(), B = 2, D = 8;
  const auto f64 = at::TensorOptions(at::kDouble);
  const at::Tensor q = at::randn({B, c.seq_len, c.q_heads, D}, f64);
  const at::Tensor k = at::randn({B, c.seq_len, c.kv_heads, D}, f64);
  const at::Tensor v = at::randn({B, c.seq_len, c.kv_heads, D}, f64);
  const at::Tensor w = at::randn({B, c.seq_len, c.q_heads * D}, f64);  // the loss's weights

  at::Tensor rq = q.clone().requires_grad_(), rk = k.clone().requires_grad_(),
             rv = v.clone().requires_grad_();
  const at::Tensor ref = one_device(rq, rk, rv, c);
  (ref * w).sum().backward();

  const at::Tensor ids = ids_of(c);
  const cp::ContextLayout layout =
      c.balanced ? cp::balanced_layout(ids, cp) : cp::head_tail_layout(B, c.seq_len, cp, ids);
  at::Tensor first_out;
  for (RotateMethod rotate : {RotateMethod::ring, RotateMethod::all_gather}) {
    SCOPED_TRACE(cp::rotate_method_name(rotate));
    at::Tensor lq = layout.shard(q, r).requires_grad_(), lk = layout.shard(k, r).requires_grad_(),
               lv = layout.shard(v, r).requires_grad_();
    CommDebugMode comm;
    const at::Tensor out =
        cp::context_attention(lq, lk, lv, layout, mesh.get_group(0),
                              {.window = c.window, .scale = c.scale, .rotate = rotate});
    EXPECT_EQ(comm.get_comm_counts(), expected_counts(rotate, cp, false));
    comm.enter();
    (out * layout.shard(w, r)).sum().backward();
    EXPECT_EQ(comm.get_comm_counts(), expected_counts(rotate, cp, true));
    comm.exit();
    EXPECT_TENSOR_CLOSE(gathered(out, layout), ref, 1e-10, 1e-12);
    EXPECT_TENSOR_CLOSE(gathered(lq.grad(), layout), rq.grad(), 1e-10, 1e-12);
    EXPECT_TENSOR_CLOSE(gathered(lk.grad(), layout), rk.grad(), 1e-10, 1e-12);
    EXPECT_TENSOR_CLOSE(gathered(lv.grad(), layout), rv.grad(), 1e-10, 1e-12);
    // Both methods meet the blocks in the same order and merge them alike.
    if (first_out.defined()) {
      EXPECT_TENSOR_EQ(out, first_out);
    }
    first_out = out.detach();
  }
}

}  // namespace

TEST(ContextAttention, RingAndAllGatherEqualOneDeviceAttendingWithinEachDocument) {
  const auto sizes = world_sizes_to_run({2, 4});
  if (sizes.empty()) GTEST_SKIP() << "runs with 2 or 4 ranks";
  for (int n : sizes) {
    SCOPED_TRACE("cp = " + std::to_string(n));
    run_ranks(n, [](int) {
      for (const Case& c : cases()) check_case(c);
    });
  }
}

// A ring that ignored document boundaries would let a document's queries see the previous
// document's keys: its outputs would differ from each document alone.
TEST(ContextAttention, DocumentsNeverSeeEachOther) {
  const auto sizes = world_sizes_to_run({2});
  if (sizes.empty()) GTEST_SKIP() << "runs with 2 ranks";
  run_ranks(2, [](int) {
    const DeviceMesh& mesh = cp_mesh();
    const int64_t r = mesh.get_local_rank();
    const at::Tensor ids = cp::document_ids_from_lengths({{9, 9}}, 18);
    const auto layout = cp::balanced_layout(ids, 2);
    const at::Tensor q = at::randn({1, 18, 2, 4}, at::kDouble);
    const at::Tensor k = at::randn({1, 18, 2, 4}, at::kDouble);
    const at::Tensor v = at::randn({1, 18, 2, 4}, at::kDouble);
    // The second document's keys and values changed: the first document's outputs must not move.
    const at::Tensor k2 = k.clone(), v2 = v.clone();
    k2.narrow(1, 9, 9).normal_();
    v2.narrow(1, 9, 9).normal_();
    auto run = [&](const at::Tensor& kk, const at::Tensor& vv) {
      return gathered(cp::context_attention(layout.shard(q, r), layout.shard(kk, r),
                                            layout.shard(vv, r), layout, mesh.get_group(0)),
                      layout);
    };
    const at::Tensor a = run(k, v), b = run(k2, v2);
    EXPECT_TENSOR_EQ(a.narrow(1, 0, 9), b.narrow(1, 0, 9));
    EXPECT_FALSE(at::allclose(a.narrow(1, 9, 9), b.narrow(1, 9, 9)));
  });
}

// The DTensor form on a (cp, tp) mesh: the sequence Shard(1) over cp, heads Shard(2) over tp.
TEST(ContextAttention, DTensorsWithHeadsShardedOverTp) {
  const auto sizes = world_sizes_to_run({4});
  if (sizes.empty()) GTEST_SKIP() << "runs with 4 ranks";
  run_ranks(4, [](int) {
    const DeviceMesh mesh = init_device_mesh("cpu", {2, 2}, {"cp", "tp"});
    const Case c{"cp x tp", 29, {{10, 4, 15}, {29}}, true, 4, 2, 0, 0};
    const at::Tensor q = at::randn({2, 29, 4, 8}, at::kDouble);
    const at::Tensor k = at::randn({2, 29, 2, 8}, at::kDouble);
    const at::Tensor v = at::randn({2, 29, 2, 8}, at::kDouble);
    at::Tensor rq = q.clone().requires_grad_(), rk = k.clone().requires_grad_(),
               rv = v.clone().requires_grad_();
    const at::Tensor ref = one_device(rq, rk, rv, c);
    ref.pow(2).sum().backward();
    const auto layout = cp::balanced_layout(ids_of(c), 2);
    auto dist = [&](const at::Tensor& x) {
      const at::Tensor d = cp::distribute_sequence(x, layout, mesh);  // (Shard(1), Replicate)
      return redistribute(d, {Shard(1), Shard(2)}).detach().requires_grad_();
    };
    const at::Tensor dq = dist(q), dk = dist(k), dv = dist(v);
    CommDebugMode comm;
    const at::Tensor out = cp::context_attention(dq, dk, dv, layout, "cp");
    EXPECT_EQ(comm.get_comm_counts(), (CommCounts{{CommType::send, 1}, {CommType::recv, 1}}));
    EXPECT_EQ(placements(out), (Placements{Shard(1), Shard(2)}));
    to_local(out).pow(2).sum().backward();
    comm.exit();
    EXPECT_TENSOR_CLOSE(layout.unshard(full_tensor(out)), ref, 1e-10, 1e-12);
    EXPECT_TENSOR_CLOSE(layout.unshard(full_tensor(dq.grad())), rq.grad(), 1e-10, 1e-12);
    EXPECT_TENSOR_CLOSE(layout.unshard(full_tensor(dk.grad())), rk.grad(), 1e-10, 1e-12);
    EXPECT_TENSOR_CLOSE(layout.unshard(full_tensor(dv.grad())), rv.grad(), 1e-10, 1e-12);
  });
}

TEST(ContextAttention, RefusesWhatItCannotRun) {
  const auto sizes = world_sizes_to_run({2});
  if (sizes.empty()) GTEST_SKIP() << "runs with 2 ranks";
  run_ranks(2, [](int) {
    const DeviceMesh& mesh = cp_mesh();
    const auto group = mesh.get_group(0);
    const auto layout = cp::head_tail_layout(1, 16, 2);  // 8 slots per rank
    const at::Tensor q = at::randn({1, 8, 4, 8}), kv = at::randn({1, 8, 2, 8});
    EXPECT_ERROR(cp::context_attention(at::randn({1, 7, 4, 8}), at::randn({1, 7, 2, 8}),
                                       at::randn({1, 7, 2, 8}), layout, group),
                 c10::Error, "q has batch 1 and 7 slots per rank, but the layout has 1 rows of 8");
    EXPECT_ERROR(
        cp::context_attention(q, at::randn({1, 8, 3, 8}), at::randn({1, 8, 3, 8}), layout, group),
        c10::Error, "4 query heads cannot share 3 KV heads evenly");
    EXPECT_ERROR(cp::context_attention(q, kv, kv, cp::head_tail_layout(1, 32, 4), group),
                 c10::Error, "has 2 ranks but the layout splits over cp = 4");
    EXPECT_ERROR(cp::context_attention(q, kv, kv, layout, group, {.window = -1}), c10::Error,
                 "window must be >= 0");
    {
      ops::LayoutInvariantMode invariant;
      EXPECT_ERROR(cp::context_attention(q, kv, kv, layout, group), c10::NotImplementedError,
                   "the layout-invariant mode is not supported under context parallelism");
    }
    EXPECT_ERROR(cp::parse_rotate_method("alltoall"), c10::ValueError,
                 "unknown rotate method 'alltoall'; expected all_gather or ring");
    const at::Tensor replicated = distribute_tensor(at::randn({1, 16, 4, 8}), mesh, {Replicate()});
    EXPECT_ERROR(cp::context_attention(replicated, replicated, replicated, layout, "cp"),
                 c10::Error, "expected Shard(1) (the sequence) on mesh dim 'cp'");
    EXPECT_ERROR(cp::context_attention(q, kv, kv, layout, "cp"), c10::Error,
                 "expected q, k and v as DTensors");
  });
}
