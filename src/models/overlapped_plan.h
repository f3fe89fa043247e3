#pragma once
// The plan entries of overlap_comm (TensorParallelOptions; docs/ARCHITECTURE.md, "Overlapping
// communication in sequence-parallel linears"): parallel styles that give the attention, the
// feed-forward and the output head a forward wrapper (dtensor/tp/forward_wrapper.h) running their
// sequence-parallel projections through tp::all_gather_matmul and tp::matmul_reduce_scatter on
// the plan's mesh, in place of the conversion hooks of the plan without overlap. The modules
// themselves know nothing of it.
#include <cstdint>

#include "dtensor/tp/parallel_style.h"

namespace dtensor::models::detail {

// On an AttentionImpl whose wq/wk/wv are ColwiseParallel and wo RowwiseParallel (their own
// entries shard them; their hooks then never run): the input gathered in up to `chunks` pieces
// while the three projections multiply, the output reduce-scattered piece by piece.
tp::Style overlapped_attention(int64_t chunks);

// The same on a FeedForwardImpl (w1/w3 Colwise, w2 Rowwise).
tp::Style overlapped_feed_forward(int64_t chunks);

// On the output head (a dtensor::nn::Linear): its weight sharded on the vocabulary rows (as
// ColwiseParallel shards it; left alone when `shares_embedding`, the embedding's rows), its
// sequence-sharded input gathered in pieces while multiplied; the logits vocab-sharded under
// `loss_parallel`, else gathered whole.
tp::Style overlapped_head(int64_t chunks, bool loss_parallel, bool shares_embedding);

}  // namespace dtensor::models::detail
