#pragma once
// Text generation for the decoder with a KV cache, at any TP degree.
//
//   Transformer model(DecoderConfig::preset("tiny"));
//   apply_tensor_parallel(*model, mesh, {.sequence_parallel = false});  // or any plan options
//   GenerateOptions opts;
//   opts.max_new_tokens = 32;
//   opts.temperature = 0.8;
//   opts.top_p = 0.9;
//   opts.seed = 7;
//   opts.on_token = [](int64_t row, int64_t token) { ... };           // streaming
//   GenerateResult out = generate(*model, {{1, 2, 3}, {4, 5}}, opts);  // same on every rank
//
// Inference runs on each rank's local shards with explicit collectives (no DTensor dispatch):
// attention heads and FFN columns split as the TP plan split them, so a step of S tokens issues
// one all-reduce for the (vocab-sharded) embedding, two per layer (after wo and after w2) and one
// all-gather of the last position's vocab-sharded logits. Sequence parallelism is not used
// while generating, whatever the plan says: a decode step has one position, which cannot be
// split, and for prefill it would turn each all-reduce into a reduce-scatter plus an all-gather
// moving the same bytes, saving only the norms' O(S * dim) work.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "dtensor/models/transformer.h"

namespace dtensor::models {

/// Keys and values of this rank's KV heads for every layer, preallocated for max_len positions:
/// per layer two tensors (B, max_len, local_kv_heads, head_dim) in the model's dtype, so the
/// bytes per rank are 2 * n_layers * B * max_len * local_kv_heads * head_dim * element size.
/// local_kv_heads is n_kv_heads / tp when the plan shards the KV heads, else the heads the rank's
/// query heads use (kv_heads_of_rank), and n_kv_heads without TP.
///
/// Rows are left-padded: row b's prompt starts at slot pad[b]; slots before it are never
/// attended to and the rotary position of slot t is t - pad[b], as if the row were alone.
class KVCache {
 public:
  /// Allocates zeroed caches for `batch` rows of up to `max_len` positions (<= max_seq_len) on
  /// the model's device and dtype, with no padding; throws on bad sizes.
  KVCache(const TransformerImpl& model, int64_t batch, int64_t max_len);

  /// Number of KV heads this rank keeps for `model` (local_kv_heads above).
  static int64_t local_kv_heads(const TransformerImpl& model);
  int64_t batch() const { return batch_; }      ///< Rows (B).
  int64_t max_len() const { return max_len_; }  ///< Positions allocated per row.
  int64_t length() const { return length_; }    // slots filled
  /// Bytes allocated for keys and values, all layers.
  int64_t bytes() const;
  /// Keys of `layer`, (B, max_len, heads, head_dim).
  at::Tensor& keys(int64_t layer) { return keys_.at(layer); }
  /// Values of `layer`, same shape as keys.
  at::Tensor& values(int64_t layer) { return values_.at(layer); }
  /// (B,) int64: the padding slots in front of each row (set before the first forward).
  const at::Tensor& padding() const { return padding_; }
  /// Sets padding() ((B,) int64); throws unless the cache is empty (length() == 0).
  void set_padding(at::Tensor padding);
  void advance(int64_t n) { length_ += n; }  ///< Marks `n` more slots filled.
  void reset() { length_ = 0; }              ///< Empties the cache (length() = 0).

 private:
  int64_t batch_, max_len_, length_ = 0;
  std::vector<at::Tensor> keys_, values_;
  at::Tensor padding_;
};

/// The model's forward on local shards, writing into and reading from a KVCache: the cached
/// inference engine generate() runs. Built once per model (it takes the local weights, selecting
/// the replicated KV heads a rank keeps); the model must not be re-parallelized or have its
/// parameters replaced while a CachedDecoder uses it. Which weights it takes, and how each must
/// be placed, comes from the parameter schema (src/models/parameter_schema.cpp); the TP mesh and
/// the KV-head layout from the parameters' DTensor specs.
class CachedDecoder {
 public:
  /// Takes `model`'s local weights (and the TP mesh its parameters lie on, when parallelized).
  explicit CachedDecoder(const TransformerImpl& model);

  /// tokens (B, S) int64, the same on every rank, at slots [cache.length(), +S). Returns the
  /// whole-vocabulary logits of the last position (B, vocab) in the model's dtype, identical on
  /// every rank, and advances the cache by S.
  at::Tensor forward(const at::Tensor& tokens, KVCache& cache);

  const DecoderConfig& config() const { return config_; }  ///< The model's configuration.
  int64_t tp() const { return tp_; }                       ///< TP degree (1 without TP).

 private:
  at::Tensor embed(const at::Tensor& tokens) const;
  at::Tensor all_reduce(const at::Tensor& t) const;
  at::Tensor row_parallel(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) const;
  static at::Tensor column_parallel(const at::Tensor& x, const at::Tensor& w,
                                    const at::Tensor& bias);

  DecoderConfig config_;
  std::optional<DeviceMesh> mesh_;
  int64_t tp_ = 1, rank_ = 0;
  at::Tensor embedding_, norm_, output_;  // local shards
  int64_t vocab_offset_ = 0;              // first vocab row of embedding_ (and output_)
  // Per block, its local weights by the role the schema gives them (undefined where the config
  // has none), and its sliding window (0: none).
  std::vector<std::vector<at::Tensor>> layers_;
  std::vector<int64_t> windows_;
  at::Tensor rope_;        // (max_seq_len, head_dim / 2, 2) in the model's dtype
  at::Tensor local_rope_;  // the sliding layers' table (rope_local_theta), else rope_
  double eps_;
};

/// The former name of CachedDecoder, kept one release.
using Decoder [[deprecated("renamed CachedDecoder")]] = CachedDecoder;

/// How the next token is chosen from the logits.
struct SamplingOptions {
  double temperature = 0;  // 0: greedy (argmax)
  int64_t top_k = 0;       // keep the k most likely tokens; 0: all
  double top_p = 1.0;      // keep the smallest set whose probability reaches top_p; 1: all
  uint64_t seed = 0;       ///< Seed of the sampling generator.
};

/// The next token of each row of logits (B, V) (whole vocabulary). Sampling draws one uniform
/// number per row from a generator seeded by (seed, step) and inverts the cumulative
/// distribution over the tokens sorted by probability, in float64: every rank, and every TP
/// degree, picks the same token from the same logits.
at::Tensor sample_next_tokens(const at::Tensor& logits, const SamplingOptions& options,
                              int64_t step);

/// Options of generate(): sampling, length, stopping and callbacks.
struct GenerateOptions : SamplingOptions {
  int64_t max_new_tokens = 32;       ///< Upper bound on new tokens per row.
  std::vector<int64_t> stop_tokens;  // a row stops after emitting one (it is included)
  int64_t pad_token = 0;             // fills the left padding (never attended to)
  /// Called on every rank, in order, for each new token of a row still running.
  std::function<void(int64_t row, int64_t token)> on_token;
  /// Called with the logits each forward returns (prefill first, then each decode step).
  std::function<void(const at::Tensor& logits)> on_logits;
};

/// What generate() returns.
struct GenerateResult {
  std::vector<std::vector<int64_t>> tokens;        // new tokens per prompt
  int64_t prompt_tokens = 0;                       // real (unpadded) prompt tokens
  int64_t new_tokens = 0;                          ///< Total new tokens over all rows.
  int64_t decode_steps = 0;                        // forwards after the prefill
  double prefill_seconds = 0, decode_seconds = 0;  ///< Wall-clock times, in seconds.
};

/// Generates for every prompt (non-empty token lists, identical on every rank) at once; a row
/// stops at a stop token or after max_new_tokens. Collective: every TP rank calls it.
GenerateResult generate(const TransformerImpl& model,
                        const std::vector<std::vector<int64_t>>& prompts,
                        const GenerateOptions& options = {});

}  // namespace dtensor::models
