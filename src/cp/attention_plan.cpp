// Planning one rank's share of context-parallel attention (attention_plan.h).
#include "attention_plan.h"

#include <ATen/ATen.h>

#include <limits>
#include <map>
#include <tuple>

namespace dtensor::cp::detail {
namespace {

// Slots [slot, slot + len) of one rank hold the tokens [token, token + len) of document `doc`.
struct Run {
  int64_t slot, len, token, doc;
};

// The maximal runs of consecutive tokens of one document in a rank's slots of row b.
std::vector<Run> runs_of(const at::TensorAccessor<int64_t, 1>& index,
                         const at::TensorAccessor<int64_t, 1>& doc, int64_t first, int64_t n) {
  std::vector<Run> runs;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t t = index[first + s], d = doc[first + s];
    if (t < 0) continue;
    if (!runs.empty()) {
      Run& last = runs.back();
      if (last.doc == d && last.slot + last.len == s && last.token + last.len == t) {
        ++last.len;
        continue;
      }
    }
    runs.push_back({s, 1, t, d});
  }
  return runs;
}

// How queries `q` see keys `k` (a query at token i sees the key at token j of its document when
// j <= i and, with a window w > 0, i - j < w); false when no pair sees each other.
bool classify(const Run& q, const Run& k, int64_t window, BlockKind& kind) {
  if (q.doc != k.doc) return false;
  const int64_t q_last = q.token + q.len - 1, k_last = k.token + k.len - 1;
  if (k.token > q_last) return false;                          // every key after every query
  if (window > 0 && q.token - k_last >= window) return false;  // every key out of the window
  if (k_last <= q.token && (window == 0 || q_last - k.token < window)) {
    kind = BlockKind::full;
  } else if (k.token == q.token && (window == 0 || q.len <= window)) {
    kind = BlockKind::causal;
  } else {
    kind = BlockKind::masked;
  }
  return true;
}

}  // namespace

AttentionPlan plan_attention(const ContextLayout& layout, int64_t rank, int64_t window) {
  const int64_t cp = layout.cp_size(), n = layout.local_len(), B = layout.batch();
  AttentionPlan plan;
  plan.cp = cp;
  plan.rank = rank;
  plan.window = window;
  plan.steps.resize(cp);
  const auto index = layout.sequence_index().accessor<int64_t, 2>();
  const auto doc = layout.document().accessor<int64_t, 2>();
  // Each row's runs on every rank (a key block's runs are its owner's).
  std::vector<std::vector<std::vector<Run>>> runs(B, std::vector<std::vector<Run>>(cp));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < cp; ++r) runs[b][r] = runs_of(index[b], doc[b], r * n, n);
  for (int64_t j = 0; j < cp; ++j) {
    const int64_t src = ((rank - j) % cp + cp) % cp;
    // Identical tasks of different rows become one task over those rows.
    using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, BlockKind, int64_t>;
    std::map<Key, std::vector<int64_t>> rows_of;
    std::vector<Key> order;
    for (int64_t b = 0; b < B; ++b) {
      for (const Run& q : runs[b][rank]) {
        for (const Run& k : runs[b][src]) {
          BlockKind kind{};
          if (!classify(q, k, window, kind)) continue;
          const int64_t offset = kind == BlockKind::masked ? q.token - k.token : 0;
          const Key key{q.slot, q.len, k.slot, k.len, kind, offset};
          auto [it, fresh] = rows_of.try_emplace(key);
          if (fresh) order.push_back(key);
          it->second.push_back(b);
        }
      }
    }
    for (const Key& key : order) {
      BlockTask task;
      std::tie(task.q_slot, task.q_len, task.k_slot, task.k_len, task.kind, task.offset) = key;
      auto& rows = rows_of[key];
      if (static_cast<int64_t>(rows.size()) != B) task.rows = std::move(rows);
      plan.steps[j].push_back(std::move(task));
    }
  }
  return plan;
}

at::Tensor block_mask(const BlockTask& task, int64_t window, const at::TensorOptions& options) {
  const auto longs = options.dtype(at::kLong);
  const at::Tensor q = at::arange(task.q_len, longs).view({-1, 1}) + task.offset;
  const at::Tensor k = at::arange(task.k_len, longs).view({1, -1});
  at::Tensor sees = k <= q;
  if (window > 0) sees = sees & (k > q - window);
  return at::zeros({task.q_len, task.k_len}, options)
      .masked_fill_(sees.logical_not(), -std::numeric_limits<double>::infinity());
}

}  // namespace dtensor::cp::detail
