#pragma once
// Attention under context parallelism: each rank holds its slots of the sequence (a
// ContextLayout) and computes its queries' attention over every rank's keys and values, exactly
// as one device would (docs/ARCHITECTURE.md, "Context parallelism").
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

#include "dtensor/comm/process_group.h"
#include "dtensor/cp/context_layout.h"

namespace dtensor::cp {

/// How keys and values reach the other ranks (PyTorch's set_rotate_method; Megatron's
/// cp_comm_type "all_gather" and "p2p").
enum class RotateMethod : uint8_t {
  /// One all-gather of the keys and one of the values per layer forward; backward reduce-scatters
  /// their gradients (2 reduce-scatters). Keeps every rank's keys and values for backward.
  all_gather,
  /// A ring: each rank passes the key/value block it holds to the next rank while computing on
  /// it, cp - 1 exchanges forward (one send and one receive each); backward passes the blocks
  /// round again (cp - 1 exchanges) and their key/value gradients with them, which reach their
  /// owners after cp exchanges. Keeps only this rank's keys and values.
  ring,
};

/// "all_gather" / "ring".
const char* rotate_method_name(RotateMethod m);
/// RotateMethod from its name; fails listing the names.
RotateMethod parse_rotate_method(const std::string& name);

struct ContextAttentionOptions {
  /// Sliding window (HF sliding_window): a query sees at most this many keys, itself included;
  /// 0: none.
  int64_t window = 0;
  /// Scores scaled by this; 0: 1 / sqrt(head_dim).
  double scale = 0;
  RotateMethod rotate = RotateMethod::ring;
};

/// Causal attention within documents for this rank's slots of `layout`: q (B, n, Hq, D), k and
/// v (B, n, Hkv, D) (n = layout.local_len(); Hq a multiple of Hkv, query head j using KV head
/// j / (Hq / Hkv); the heads this rank holds, all of them without TP) over the keys and values of
/// every rank of `cp_group` (of layout.cp_size() ranks, this rank's group rank its part).
/// Returns (B, n, Hq * D) as models' attention does; padding slots attend nothing and give 0.
/// Differentiable: the gradients of k and v are this rank's own. Blocks are combined by their
/// row maxima and log-sum-exp (flash attention's online softmax), so the result equals one
/// device's attention to rounding. CPU tensors (the flash kernel of LibTorch's CPU SDPA) and
/// meta tensors.
at::Tensor context_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const ContextLayout& layout,
                             const std::shared_ptr<comm::ProcessGroup>& cp_group,
                             const ContextAttentionOptions& options = {});

/// The same on DTensors (B, cp * n, H, D) whose dim 1 is Shard(1) over the mesh dim `cp_dim`
/// (distribute_sequence's layout) and Replicate or Shard(2) (heads) on every other mesh dim; q,
/// k and v on one mesh. Returns a DTensor (B, cp * n, Hq * D) with q's placements.
at::Tensor context_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const ContextLayout& layout, const std::string& cp_dim,
                             const ContextAttentionOptions& options = {});

}  // namespace dtensor::cp
