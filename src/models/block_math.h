#pragma once
// The math of one decoder block after its projections, written once and run by every path:
// training and pipeline stages (AttentionImpl / FeedForwardImpl, on the local tensors the TP plan
// hands them) and generation (Decoder, on local shards with a KV cache). Per-family differences
// are arguments (a q/k norm weight, a sliding window), never copies of the math.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>

namespace dtensor::models::detail {

// The cache slots of one layer: keys and values (B, max_len, kv_heads, head_dim), of which
// [0, start) are filled; the new keys and values go to [start, start + S).
struct LayerCache {
  at::Tensor& keys;
  at::Tensor& values;
  int64_t start;
};

// x: (B, S, H * head_dim) projected heads -> (B, S, H, head_dim): each head normalised by
// RMSNorm with `norm_weight` (head_dim; undefined: none, as without q_norm/k_norm; scaled by
// norm_offset + weight as dtensor::nn::rms_norm) and then rotated by `rope` ((1 or B, S,
// head_dim / 2, 2) cos and sin; undefined: not rotated, values).
at::Tensor heads(const at::Tensor& x, int64_t head_dim, const at::Tensor& norm_weight, double eps,
                 const at::Tensor& rope, double norm_offset = 0);

// Which keys each query sees, as a boolean mask (1 or B, 1, S, start + S), for S queries at slots
// [start, start + S): key slot s is seen by query slot t when pad[b] <= s <= t and, with a sliding
// window w > 0, t - s < w (HF's kv_idx > q_idx - sliding_window); a query always sees itself, so
// a padding query keeps a finite softmax. Undefined when that is plain causal attention (start 0,
// no padding, no window): attend() then lets SDPA build it (is_causal).
at::Tensor attention_mask(int64_t start, int64_t S, const at::Tensor& padding, int64_t window,
                          const at::Device& device);

// LayoutInvariantMode: this LibTorch's CPU matrix products give a row the same bits whatever the
// number of rows from this many on (fewer take another kernel path), so the mode runs a decode
// step's products with its rows padded to it: a decode row then equals the prefill's row.
inline constexpr int64_t kInvariantMinRows = 4;
// LayoutInvariantMode: attention with a cache runs over the filled slots rounded up to a multiple
// of this many (masked), so the number of slots a row sees is one of a few whole-block sizes.
inline constexpr int64_t kInvariantKeyBlock = 64;

// f(x) for x (M, K), with x padded by zero rows to kInvariantMinRows first in LayoutInvariantMode
// (the extra output rows dropped); f(x) itself otherwise.
at::Tensor rows_padded(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& f);

// Scaled dot-product attention of q (B, S, Hq, D) over k, v (B, S, Hkv, D) (Hq a multiple of Hkv;
// query head j uses KV head j / (Hq / Hkv)), with `mask` from attention_mask. With a cache, k and
// v are written to its slots first and the queries attend to all filled slots. Returns
// (B, S, Hq * D). Scores are scaled by `scale` (0: 1 / sqrt(D)). In LayoutInvariantMode with a
// cache, every query attends over the filled slots rounded up to whole kInvariantKeyBlock blocks
// (the slots it does not see masked) with at least kInvariantMinRows queries, so a decode step
// and a prefill's row give the same bits. With `sinks` (this rank's query heads'; gpt-oss) each
// head's softmax has its sink logit too (attend_with_sinks); not in LayoutInvariantMode.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& mask, LayerCache* cache = nullptr, double scale = 0,
                  const at::Tensor& sinks = {});

// The gated MLP's middle: act(gate) * up, act DecoderConfig::activation's ("silu": SwiGLU,
// "gelu_tanh": GeGLU).
at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& up,
                            const std::string& activation = "silu");

// Token embeddings h as the first block takes them: times sqrt(dim) rounded to h's dtype when
// `scale` (Gemma, which rounds the factor before multiplying), else h itself.
at::Tensor scale_embeddings(const at::Tensor& h, int64_t dim, bool scale);

// Logits soft-capped as cap * tanh(x / cap) (HF's order of operations); cap 0: x itself. Plain
// or DTensor (vocab-sharded) logits alike: the math is elementwise.
at::Tensor softcap(const at::Tensor& x, double cap);

}  // namespace dtensor::models::detail
