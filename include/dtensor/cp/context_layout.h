#pragma once
// Which tokens of a batch each rank of a context-parallel ("cp") mesh dim holds: the sequence
// dimension, reordered by a load balancer and padded to equal parts, is Shard(1) over cp
// (docs/ARCHITECTURE.md, "Context parallelism").
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "dtensor/mesh/device_mesh.h"

namespace dtensor::cp {

/// The tokens of a (B, S) batch laid out over `cp` ranks: every row becomes cp * local_len()
/// slots, rank-major (rank r holds slots [r * local_len, (r + 1) * local_len) of every row), each
/// slot a token of the row or padding. Causal attention runs within documents: a token sees the
/// tokens of its own document at or before it (a row without document ids is one document), and
/// padding is seen by no one. Built by head_tail_layout or balanced_layout, identically on every
/// rank (from replicated document ids). Cheap to copy (shared, immutable).
class ContextLayout {
 public:
  /// Number of ranks the sequence is split over.
  int64_t cp_size() const;
  /// Rows of the batch.
  int64_t batch() const;
  /// Tokens per row of the batch (before the layout's padding).
  int64_t seq_len() const;
  /// Slots each rank holds per row: ceil(seq_len / cp) rounded up as the split needs.
  int64_t local_len() const;
  /// Whether the rows carry document ids (else each row is one document).
  bool has_documents() const;
  /// (B, cp * local_len) int64 on the CPU: the position in its row of the token in each slot,
  /// -1 for padding.
  const at::Tensor& sequence_index() const;
  /// (B, cp * local_len) int64: the document of each slot's token, -1 for padding.
  const at::Tensor& document() const;
  /// (B, cp * local_len) int64: each slot's rotary position, the token's position within its
  /// document (the position in the row when the row is one document); 0 for padding.
  const at::Tensor& positions() const;

  /// Rank `rank`'s slots of `x` (dim 0 the batch, `seq_dim` the row of seq_len tokens, any
  /// other dims), padding slots filled with `pad`: the local tensor of x's Shard(seq_dim) over
  /// cp. Fails naming `what` when x's batch or sequence length is not this layout's.
  at::Tensor shard(const at::Tensor& x, int64_t rank, int64_t seq_dim = 1, double pad = 0,
                   const char* what = "tensor") const;
  /// The batch back in sequence order from every rank's slots concatenated in rank order
  /// (dim `seq_dim` of length cp * local_len): (.., seq_len, ..); padding dropped, tokens the
  /// layout does not place (padding documents, id -1) filled with 0.
  at::Tensor unshard(const at::Tensor& gathered, int64_t seq_dim = 1) const;

  /// The (query, key) pairs each rank's queries attend, cp numbers: the work of causal attention
  /// within documents (a sliding window w > 0 lets a token see at most w keys, itself included).
  std::vector<int64_t> attended_pairs(int64_t window = 0) const;
  /// max / mean of attended_pairs: 1 is a perfect balance.
  double imbalance(int64_t window = 0) const;

  /// Used by the layout builders: every tensor (B, cp * local_len) int64 on the CPU.
  ContextLayout(int64_t cp, int64_t seq_len, bool has_documents, at::Tensor sequence_index,
                at::Tensor document, at::Tensor positions);

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

/// Document ids (B, seq_len) int64 from each row's document lengths, in order: document d of a
/// row is id d; tokens after a row's last document are padding (id -1). Fails when a row's
/// lengths add up to more than seq_len or a length is not positive.
at::Tensor document_ids_from_lengths(const std::vector<std::vector<int64_t>>& lengths,
                                     int64_t seq_len);

/// The head-tail (zig-zag) split: each row cut into 2 * cp equal chunks (padded at its end to a
/// multiple of 2 * cp), rank r holding chunks r and 2 * cp - 1 - r, which gives every rank the
/// same work for one causal sequence. `document_ids` (B, S), optional: documents packed in the
/// rows (non-decreasing ids >= 0, padding -1 at a row's end), attended within themselves.
/// Fails when seq_len < cp.
ContextLayout head_tail_layout(int64_t batch, int64_t seq_len, int64_t cp,
                               const at::Tensor& document_ids = {});

/// The split of packed documents balanced by attention work, for documents of any lengths: each
/// document of length L is cut into 2 * cp chunks of floor(L / (2 * cp)) tokens dealt head-tail
/// (equal work on every rank), and its last L mod (2 * cp) tokens go one by one, heaviest first,
/// to the rank with the least work that has room; each rank's slots are then padded at their end
/// to ceil(S / cp). No divisibility rule on the lengths; the most loaded rank stays within about
/// one token's keys of the mean. `document_ids` (B, S) as for head_tail_layout.
ContextLayout balanced_layout(const at::Tensor& document_ids, int64_t cp);

/// `x` as a DTensor on `mesh`, Shard(seq_dim) over the mesh dim `cp_dim` and Replicate on the
/// others, whose local tensor is layout.shard(x, this rank's cp coordinate): the global tensor is
/// the batch in the layout's slot order (PyTorch's context_parallel shards its buffers the same
/// way). Differentiable like distribute_tensor's local part.
at::Tensor distribute_sequence(const at::Tensor& x, const ContextLayout& layout,
                               const DeviceMesh& mesh, const std::string& cp_dim = "cp",
                               int64_t seq_dim = 1, double pad = 0);

}  // namespace dtensor::cp
