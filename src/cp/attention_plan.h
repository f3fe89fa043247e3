#pragma once
// Which pieces of attention one rank computes under context parallelism: for each key block it
// meets (its own, then each other rank's, in ring order), the (query run, key run) pairs that
// see each other and how (wholly, causally from a common start, or through a mask), with the
// batch rows that share them. Computed on the host from the layout alone, identically for the
// forward and the backward.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "dtensor/cp/context_layout.h"

namespace dtensor::cp::detail {

// How a query run sees a key run of the same document.
enum class BlockKind : uint8_t {
  full,    // every query sees every key (the keys all come before the queries)
  causal,  // both start at the same token: query i sees keys 0..i (SDPA's is_causal, top-left)
  masked,  // anything else (windows, interleaved runs): an explicit mask
};

// Queries in local slots [q_slot, q_slot + q_len) against keys in slots [k_slot, k_slot + k_len)
// of the key block, for the batch rows `rows` (empty: every row).
struct BlockTask {
  std::vector<int64_t> rows;
  int64_t q_slot = 0, q_len = 0, k_slot = 0, k_len = 0;
  BlockKind kind = BlockKind::full;
  // masked: the first query's position in the row minus the first key's (with q_len, k_len and
  // the window it fixes the mask).
  int64_t offset = 0;
};

struct AttentionPlan {
  int64_t cp = 1, rank = 0, window = 0;
  // steps[j]: the tasks against the key block of rank (rank - j) mod cp.
  std::vector<std::vector<BlockTask>> steps;
};

// The plan of rank `rank` for causal attention within documents with sliding window `window`
// (0: none; else a query sees the keys at most window - 1 tokens before it).
AttentionPlan plan_attention(const ContextLayout& layout, int64_t rank, int64_t window);

// The additive mask of a masked task: (q_len, k_len), 0 where query i sees key j, -inf elsewhere,
// in `options`' dtype.
at::Tensor block_mask(const BlockTask& task, int64_t window, const at::TensorOptions& options);

}  // namespace dtensor::cp::detail
