#pragma once
// The decoder-only transformer of every family (torchtitan's llama3 model, with Qwen's, Mistral's
// and Gemma's differences as configuration) written against dtensor-cpp, and its
// tensor-parallel plan (docs/ARCHITECTURE.md, "The Llama plan"). Module and parameter names follow
// torchtitan, so plans and checkpoints use the same paths ("layers.0.attention.wq.weight").
//
//   auto config = DecoderConfig::preset("tiny");
//   Transformer model(config);
//   model->init_weights(/*seed=*/0);                 // same values for every TP degree
//   auto mesh = init_device_mesh("cpu", {tp});
//   apply_tensor_parallel(*model, mesh);             // SP + loss parallel by default
//   torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
//   auto logits = model->forward(tokens);            // tokens (B, S) int64, same on every rank
//   auto loss = token_cross_entropy(logits, targets); // plain 0-d tensor
//   loss.backward();                                 // safe outside a LossParallel guard
//   reduce_partial_grads(*model);                    // one all_reduce for the SP norm grads
//   opt.step();
//
// Without apply_tensor_parallel the model is plain LibTorch. The model knows nothing of how it is
// parallelized: the plan converts its modules' inputs and outputs with hooks (and, with
// overlap_comm, runs attention and the feed-forward through forward wrappers), and whoever needs
// the layout (the cached decoder, the KV cache) reads it from the parameters' DTensor specs.
//
// A pipeline stage is the same model with parts removed (torchtitan's Decoder): the embedding,
// the final norm and the head may be absent, and `layers` holds the stage's blocks keyed by their
// index in the whole model (dtensor/models/transformer_stage.h cuts them).
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/core/distribute_module.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/expert_parallel.h"
#include "dtensor/models/moe.h"
#include "dtensor/models/yarn_rope.h"
#include "dtensor/nn/layers.h"
#include "dtensor/tp/parallelize_module.h"
#include "dtensor/tp/partial_grads.h"

namespace dtensor::models {

/// Llama 3.1's rotary frequency scaling (Hugging Face rope_type "llama3"): wavelengths longer
/// than original_max_position_embeddings / low_freq_factor are stretched by `factor`, those
/// shorter than original_max_position_embeddings / high_freq_factor kept, and the ones between
/// interpolated smoothly.
struct Llama3RopeScaling {
  double factor = 8;  ///< How much longer the long wavelengths get.
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  int64_t original_max_position_embeddings = 8192;
};

/// The mixture-of-experts feed-forward of the sparse layers (Qwen3-MoE, Mixtral, gpt-oss;
/// docs/ARCHITECTURE.md, "Mixtures of experts"): each sparse layer's feed-forward is a MoE block
/// (router and stacked experts) instead of the dense gated MLP.
struct DecoderMoe {
  MoeOptions options;             ///< Routing, experts, activation (validate() checks it).
  int64_t expert_hidden_dim = 0;  ///< Each expert's width I (HF moe_intermediate_size).
  /// Which layers are sparse (the others keep the dense feed-forward); empty: every layer.
  std::vector<bool> sparse_layers;
  /// The training loss adds this times the load-balancing loss over the sparse layers (HF
  /// router_aux_loss_coef).
  double router_aux_loss_coef = 0.001;
};

/// Model hyperparameters of the decoder (torchtitan's ModelArgs, plus the features other
/// families need: Qwen2's q/k/v biases, Qwen3's per-head q/k norms and decoupled head size,
/// Mistral's and Qwen's sliding windows, Gemma 3's block). Fields left 0 are derived (see below);
/// the defaults (and the presets) are Llama's; the families' differences are data here
/// (docs/ARCHITECTURE.md, "One decoder, many families").
struct DecoderConfig {
  int64_t vocab_size = 256;    ///< Tokens in the vocabulary.
  int64_t dim = 32;            ///< Model (embedding) width.
  int64_t n_layers = 2;        ///< Transformer blocks.
  int64_t n_heads = 4;         ///< Query heads.
  int64_t n_kv_heads = 0;      // 0: n_heads (no GQA)
  int64_t ffn_hidden_dim = 0;  // 0: Llama's rule from dim, multiple_of and ffn_dim_multiplier
  int64_t multiple_of = 32;    ///< The derived FFN hidden size is rounded up to a multiple of this.
  std::optional<double> ffn_dim_multiplier;       ///< Scales the FFN hidden size (Llama's rule).
  int64_t max_seq_len = 128;                      ///< Longest sequence (size of the rotary table).
  double norm_eps = 1e-5;                         ///< RMSNorm epsilon.
  double rope_theta = 10000;                      ///< Rotary embedding base.
  std::optional<Llama3RopeScaling> rope_scaling;  ///< JSON: null or an object of its fields.
  bool tie_embeddings = false;                    ///< output.weight is tok_embeddings.weight.
  int64_t head_size = 0;                          // per-head width (HF head_dim); 0: dim / n_heads
  bool qkv_bias = false;  ///< wq, wk and wv have biases (Qwen2; HF attention_bias).
  bool wo_bias = false;   ///< wo has a bias (HF attention_bias of Llama and Qwen3).
  bool qk_norm = false;   ///< RMSNorm over each query and key head before rotary (Qwen3).
  /// Keys a query of a sliding layer sees, itself included (HF sliding_window); 0: none.
  int64_t sliding_window = 0;
  /// Which layers slide (HF layer_types "sliding_attention"); empty: all of them.
  std::vector<bool> sliding_layers;
  /// Rotary base of the sliding layers (Gemma 3's local layers); 0: rope_theta, as the others.
  double rope_local_theta = 0;
  /// Attention scores are scaled by query_pre_attn_scalar^-1/2 (Gemma); 0: head_dim's.
  double query_pre_attn_scalar = 0;
  /// Every RMSNorm scales by norm_weight_offset + weight (Gemma: 1, weights stored around 0).
  double norm_weight_offset = 0;
  /// In half precision every RMSNorm scales in float32 before rounding (gpt-oss), not after
  /// (Llama); see dtensor::nn::rms_norm.
  bool norm_scale_in_float32 = false;
  /// A norm after attention and after the feed-forward too, before each joins the residual
  /// (Gemma's post_attention_layernorm and post_feedforward_layernorm).
  bool post_norms = false;
  /// Token embeddings times sqrt(dim), rounded to the model's dtype first (Gemma).
  bool scale_embeddings = false;
  /// The gate's activation in the gated feed-forward: "silu" (SwiGLU) or "gelu_tanh" (GeGLU,
  /// tanh-approximated GELU: HF gelu_pytorch_tanh).
  std::string activation = "silu";
  /// Logits soft-capped to (-cap, cap) as cap * tanh(logits / cap) (HF final_logit_softcapping);
  /// 0: none.
  double final_logit_softcap = 0;
  /// Residual dropout in training: each block's attention and feed-forward outputs dropped out
  /// with this probability before they join the residual stream (models/residual_dropout.h);
  /// 0: none (Llama's and the HF families' pretrained configs).
  double dropout = 0;
  /// Mixture-of-experts feed-forwards in the sparse layers; nullopt: every layer dense.
  std::optional<DecoderMoe> moe;
  /// Each query head's softmax has one learned logit more, its sink (gpt-oss; attention_sinks.h).
  bool attention_sinks = false;
  /// YaRN rotary scaling (HF rope_type "yarn", gpt-oss); exclusive with rope_scaling.
  std::optional<YarnRopeScaling> rope_yarn;

  /// "tiny" (tests: dim 32, 2 layers, 4 heads, 2 KV heads), "tiny-moe" (tiny with 4 experts of
  /// width 16, top 2, in both layers), "demo" (~3M parameters, trains visibly in a minute at TP=2
  /// on 2 CPU cores), "bench" (~30M parameters).
  static DecoderConfig preset(const std::string& name);
  /// The preset names: "tiny", "tiny-moe", "demo", "bench".
  static std::vector<std::string> preset_names();
  /// A JSON object with any of the fields above (others keep their defaults); unknown keys
  /// are an error. to_json() writes every field, resolved values included.
  static DecoderConfig from_json(const std::string& json);
  /// Every field as a JSON object (see from_json).
  std::string to_json() const;

  int64_t kv_heads() const;  // n_kv_heads resolved
  int64_t head_dim() const;  // head_size, or dim / n_heads
  /// The sliding window of layer `layer`: sliding_window where that layer slides, else 0.
  int64_t window(int64_t layer) const;
  /// The rotary base of layer `layer`: rope_local_theta where that layer slides and it is set,
  /// else rope_theta.
  double rope_base(int64_t layer) const;
  /// The attention score scale: query_pre_attn_scalar^-1/2, or head_dim^-1/2 when it is 0.
  double attention_scale() const;
  int64_t hidden_dim() const;  // ffn_hidden_dim resolved
  /// Whether layer `layer`'s feed-forward is a mixture of experts.
  bool sparse(int64_t layer) const;
  /// Whether any layer is.
  bool has_moe() const;
  /// Total parameter count (tied weights counted once).
  int64_t num_parameters() const;
  /// Throws naming the field when the configuration is inconsistent.
  void validate() const;

  /// TP degrees the plan supports: n_heads and the FFN hidden size must split evenly (heads
  /// are never cut; the FFN halves meet in a row-sharded matmul that needs even shards). KV heads
  /// need not divide (see apply_tensor_parallel), nor the vocabulary.
  std::vector<int64_t> valid_tp_degrees() const;
  /// Throws "n_heads=6 is not divisible by tp=4; valid tp degrees: 1, 2, 3, 6" and the like.
  void validate_tp(int64_t tp) const;
};

/// The gated feed-forward: w2(act(w1(x)) * w3(x)), act as DecoderConfig::activation says (SwiGLU
/// with silu).
class FeedForwardImpl : public dtensor::nn::Module {
 public:
  /// w1 and w3 (dim -> hidden_dim) and w2 (hidden_dim -> dim), without biases.
  FeedForwardImpl(int64_t dim, int64_t hidden_dim, std::string activation = "silu");
  /// x: (..., dim) -> (..., dim).
  at::Tensor forward(const at::Tensor& x);

  dtensor::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};  ///< The three projections.
  std::string activation;                                     ///< DecoderConfig::activation.
};
/// Module holder of FeedForwardImpl.
TORCH_MODULE(FeedForward);

/// Causal multi-head attention with grouped KV heads and rotary embeddings. Heads are inferred
/// from the projections' (local) widths: view(bs, seqlen, -1, head_dim), and each query head uses
/// KV head (local index) * n_kv / n_q, so the same code runs whole or with heads sharded.
class AttentionImpl : public dtensor::nn::Module, public ParameterSwapTarget {
 public:
  /// Projections (biases as config says) and q/k norms of layer `layer_id` of `config`.
  explicit AttentionImpl(const DecoderConfig& config, int64_t layer_id = 0);
  /// x: (B, S, dim). rope: (S, head_dim / 2, 2), cos and sin of the rotation angles (real, so
  /// Gloo can communicate it); the role of torchtitan's freqs_cis. wo(attend(wq(x), wk(x),
  /// wv(x), rope)).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& rope);
  /// The attention between the projections: the projected q, k, v (B, S, heads * head_dim, the
  /// heads this rank holds) through per-head norms and rotary, the causal (sliding) mask and
  /// scaled dot-product attention; returns (B, S, q heads * head_dim). block_math.h's math, which
  /// generation runs too (and the overlapped plan around its own projections).
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& rope);

  int64_t n_heads, n_kv_heads, head_dim;  ///< Query heads, KV heads (before TP) and head size.
  int64_t window;                         ///< Sliding window of this layer; 0: none.
  double norm_eps;                        ///< Epsilon of q_norm and k_norm.
  double norm_offset;                     ///< DecoderConfig::norm_weight_offset of q/k norms.
  double scale;                           ///< Attention score scale (attention_scale()).
  /// Query, key, value and output projections.
  dtensor::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  /// Per-head RMSNorms (head_dim) of queries and keys; null unless config.qk_norm. Under TP their
  /// weights are replicated and their gradients Partial (summed by reduce_partial_grads).
  dtensor::nn::RMSNorm q_norm{nullptr}, k_norm{nullptr};
  /// Per-query-head sink logits (n_heads) with config.attention_sinks, else undefined. Under TP
  /// sharded with the heads (Shard(0)).
  at::Tensor sinks;
  /// Keeps `sinks` in step with dtensor::replace_parameter (TP, FSDP).
  void on_parameter_replaced(const std::string& name, const at::Tensor& value) override;
};
/// Module holder of AttentionImpl.
TORCH_MODULE(Attention);

/// One pre-norm block: x + attention(norm(x)), then + feed_forward(norm(.)); with
/// config.post_norms each sublayer's output is normalised again before it is added (Gemma).
class TransformerBlockImpl : public dtensor::nn::Module {
 public:
  /// Block `layer_id` of a model with `config`.
  TransformerBlockImpl(int64_t layer_id, const DecoderConfig& config);
  /// x: (B, S, dim) -> (B, S, dim); rope as for AttentionImpl::forward (this layer's table:
  /// TransformerImpl::rope with its layer).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& rope);

  int64_t layer_id;                                   ///< Index in the model's layers.
  double dropout = 0;                                 ///< DecoderConfig::dropout.
  dtensor::nn::RMSNorm attention_norm{nullptr};       ///< Norm before attention.
  Attention attention{nullptr};                       ///< Self-attention.
  dtensor::nn::RMSNorm attention_post_norm{nullptr};  ///< After attention; null without post_norms.
  dtensor::nn::RMSNorm ffn_norm{nullptr};             ///< Norm before the feed-forward.
  FeedForward feed_forward{nullptr};  ///< Gated feed-forward; null in sparse layers.
  MoE moe{nullptr};  ///< Mixture-of-experts feed-forward of a sparse layer; null in dense ones.
  dtensor::nn::RMSNorm ffn_post_norm{
      nullptr};  ///< After the feed-forward; null without post_norms.
};
/// Module holder of TransformerBlockImpl.
TORCH_MODULE(TransformerBlock);

/// The model: embedding, blocks, final norm and output projection (vocab logits); or a pipeline
/// stage of it, the same model with parts removed.
class TransformerImpl : public dtensor::nn::Module {
 public:
  /// The whole model (call init_weights next); throws when `config` is invalid.
  explicit TransformerImpl(DecoderConfig config);
  /// Stage `stage` of `num_stages` of `whole`: its blocks by pp::stage_layer_range, the
  /// embedding on the first stage, the final norm and the head on the last, all shared with
  /// `whole` (so parameter names are the whole model's). With tied embeddings and more than one
  /// stage, the last stage's head gets a copy of the embedding of its own (see
  /// tied_across_stages). Prefer split_transformer_stage (dtensor/models/transformer_stage.h).
  TransformerImpl(TransformerImpl& whole, int64_t stage, int64_t num_stages);

  /// tokens (B, S) int64 with S <= max_seq_len, identical on every rank, when the model has its
  /// embedding, else hidden states (B, S, dim). Returns logits (B, S, vocab) when it has its head
  /// - a plain tensor, or under loss-parallel TP a DTensor sharded on the vocab (Shard(-1));
  /// token_cross_entropy takes either - else hidden states.
  at::Tensor forward(const at::Tensor& input);

  /// torchtitan's initialisation drawn from `seed` alone: every parameter gets its own generator
  /// seeded from (seed, its name), values are drawn whole in float64 on the CPU and then cast.
  /// So any TP degree gets the same model. Call before or after apply_tensor_parallel (after,
  /// each rank keeps its chunk of the whole value; no communication either way). Parameters
  /// on the meta device are left as they are (see init_stage_weights).
  void init_weights(uint64_t seed);

  /// The rotary table for positions [0, seqlen) as (seqlen, head_dim / 2, 2) in `options`.
  /// Angle of position p for pair i: p * f_i with f_i = theta^(-2i / head_dim), rescaled by
  /// config().rope_scaling when set. theta is that of layer `layer` (config().rope_base); -1:
  /// rope_theta.
  at::Tensor rope(int64_t seqlen, const at::TensorOptions& options, int64_t layer = -1) const;

  const DecoderConfig& config() const { return config_; }  ///< The whole model's configuration.

  /// Token embedding (vocab, dim); null on pipeline stages after the first.
  dtensor::nn::Embedding tok_embeddings{nullptr};
  /// TransformerBlock children keyed by their index in the whole model ("0", "1", ...).
  torch::nn::ModuleDict layers{nullptr};
  /// Final norm; null on pipeline stages before the last.
  dtensor::nn::RMSNorm norm{nullptr};
  /// No bias; null on pipeline stages before the last. With tie_embeddings its weight member is
  /// tok_embeddings.weight and it registers no parameter of its own, so parameters() lists the
  /// shared weight once.
  dtensor::nn::Linear output{nullptr};

  /// The router logits (T, E) of this model's sparse blocks in their last forward, in layer order
  /// (empty without them).
  std::vector<at::Tensor> router_logits() const;
  /// load_balancing_loss over router_logits() (transformers' aux_loss, which the training loss
  /// adds config().moe->router_aux_loss_coef times: training_loss); undefined without sparse
  /// blocks. Under tensor parallelism every rank computes it whole, its gradient counted once
  /// (MoEImpl). With `data_parallel` (the run's "dp": the batch split over its ranks, their
  /// gradients averaged), it is the whole batch's (load_balancing_loss pools over the ranks).
  at::Tensor aux_loss(const std::optional<DeviceMesh>& data_parallel = std::nullopt) const;
  /// The value of the last aux_loss() (detached), for statistics; undefined before one.
  const at::Tensor& last_aux_loss() const { return last_aux_loss_; }
  /// Tokens routed to each expert (E) in the last forward, summed over the sparse blocks.
  at::Tensor tokens_per_expert() const;

  /// The block of `layer` (its index in the whole model), which this model must hold.
  TransformerBlockImpl& block(int64_t layer) const;
  /// The blocks this model holds, in order.
  std::vector<TransformerBlockImpl*> blocks() const;

  /// Which pipeline stage this is, of how many (0 of 1: the whole model).
  int64_t stage_index() const { return stage_; }
  int64_t num_stages() const { return num_stages_; }    ///< 1 for the whole model.
  int64_t first_layer() const { return first_layer_; }  ///< Index of its first block.
  int64_t end_layer() const { return end_layer_; }      ///< One past its last block.
  /// Whether this model was cut from a whole one for a pipeline (the stage constructor).
  bool is_pipeline_stage() const { return pipeline_stage_; }
  /// Whether output.weight is a copy of the embedding that lives on the first stage, kept equal
  /// by summing the two stages' gradients (make_pipeline_stage ties them).
  bool tied_across_stages() const { return tied_across_stages_; }
  /// Points output.weight at tok_embeddings.weight (again, after the embedding was replaced);
  /// nothing on a pipeline stage that lacks either.
  void tie_output_to_embedding();

 private:
  std::string stage_label() const;  // " (pipeline stage 1 of 2)" on a stage

  DecoderConfig config_;
  int64_t stage_ = 0, num_stages_ = 1, first_layer_ = 0, end_layer_ = 0;
  bool pipeline_stage_ = false, tied_across_stages_ = false;
  at::Tensor rope_table_;  // (max_seq_len, head_dim/2, 2) float64; not a buffer, never sharded
  at::Tensor local_rope_table_;       // the same for rope_local_theta; undefined when it is unset
  mutable at::Tensor last_aux_loss_;  // aux_loss()'s last value, detached
};
/// Module holder of TransformerImpl.
TORCH_MODULE(Transformer);

// ---- tensor parallelism ----

/// Options of apply_tensor_parallel.
struct TensorParallelOptions {
  /// torchtitan's plan: residual stream sharded on the sequence (norms run sequence-parallel).
  /// Off: the Megatron plan (activations replicated between blocks, norms plain).
  bool sequence_parallel = true;
  /// Logits stay vocab-sharded and the loss is computed without gathering them.
  bool loss_parallel = true;
  /// Where parameter values come from: nullopt (default) keeps each rank's own values (every
  /// rank initialised the whole model from the same seed), with no communication; a group rank
  /// scatters/broadcasts its values instead.
  std::optional<int64_t> src_data_rank;
  /// Overlap the sequence-parallel collectives of each block with its matmuls
  /// (dtensor/tp/overlap.h): the input all-gather of wq/wk/wv, w1/w3 and the output head runs
  /// in pieces, each multiplied while the next is gathered; wo and w2 reduce-scatter piece by
  /// piece while the next is multiplied; in backward the input gradient's reduce-scatter runs
  /// during the weight gradients. Bitwise the same results as without it. Needs
  /// sequence_parallel and n_kv_heads % tp == 0. Forward, per block, it issues pieces
  /// all-gathers and pieces reduce-scatters for each of attention and feed-forward instead of
  /// one, and the head pieces all-gathers instead of one (pieces =
  /// tp::overlap_chunks(seqlen / tp, overlap_chunks)); backward counts are unchanged.
  bool overlap_comm = false;
  /// The most pieces the sequence shard is cut into with overlap_comm.
  int64_t overlap_chunks = 2;
  /// A plan of the caller's own (e.g. read from a file) instead of the built-in one, applied as
  /// given: sequence_parallel must then say whether it shards the sequence between blocks (the
  /// checks of sequence parallelism are installed with it), the logits are vocab-sharded or not
  /// as its "output" entry says, and overlap_comm is refused.
  std::optional<tp::ParallelizePlan> plan;
  /// Expert parallelism folded over the tp ranks (1: off; else the tp degree): each rank holds
  /// num_experts / tp whole experts instead of 1 / tp of every expert's columns, and the sparse
  /// layers' tokens travel to them by all-to-all (ExpertParallel, expert_parallel.h), each rank
  /// routing its sequence shard (or, without sequence parallelism, its 1/tp of the tokens).
  int64_t ep = 1;
  /// The dispatch of expert parallelism (its `tokens` is the plan's to set).
  ExpertParallelOptions expert_parallel;
};

/// Parallelizes `model` over `mesh` (1-D, or the dimension named "tp" of an N-D mesh) with the
/// torchtitan plan, in place: tok_embeddings Rowwise (vocab rows), attention wq/wk/wv and
/// feed_forward w1/w3 Colwise, wo/w2 Rowwise, output Colwise (vocab), norms SequenceParallel. Needs
/// n_heads and the FFN hidden size divisible by tp (else throws listing valid degrees); with
/// sequence parallelism the sequence length must be too (a pre-hook of the model checks it, and
/// refuses residual dropout in training). KV heads: when n_kv_heads % tp == 0, wk/wv are Colwise
/// like wq; otherwise wk/wv stay replicated, every rank projects all KV heads and keeps those its
/// query heads use (their gradients are Partial and summed by reduce_partial_grads). A tied
/// embedding stays tied (both uses are Shard(0) on the vocab). A pipeline stage gets the plan of
/// the parts it holds without sequence parallelism (options.sequence_parallel is ignored): its
/// activations cross the stage boundaries as replicated plain tensors; the collectives per block
/// are those of the whole model's plan without it.
void apply_tensor_parallel(TransformerImpl& model, const DeviceMesh& mesh,
                           TensorParallelOptions options = {});

/// The plan apply_tensor_parallel applies to a whole model of `config` on `tp` ranks with
/// `options` (sequence_parallel, loss_parallel, overlap_comm), as (module path, style) in the
/// order the entries apply: the parameters' rows (src/models/parameter_schema.cpp) each give
/// their module its style. dtensor_train --print-plan writes it as a --plan file.
tp::ParallelizePlan tensor_parallel_plan(const DecoderConfig& config, int64_t tp,
                                         const TensorParallelOptions& options = {});

/// The KV heads (global indices) that TP rank `rank` of `tp` keeps, in the order its query heads
/// [rank * n_heads/tp, (rank+1) * n_heads/tp) use them: the distinct heads when each is used by the
/// same number of consecutive local query heads (the attention then repeats them), else one per
/// local query head. With n_kv_heads % tp == 0 these are the rank's ColwiseParallel rows of wk/wv.
at::Tensor kv_heads_of_rank(int64_t n_heads, int64_t n_kv_heads, int64_t rank, int64_t tp);

/// The mesh TP runs on: ParallelDims::from_mesh(mesh).mesh("tp"), i.e. the dimension named "tp"
/// (mesh_for_role's rule: a 1-D mesh without names is TP's), else nullopt.
std::optional<DeviceMesh> get_tp_mesh(const DeviceMesh& mesh);

/// Sums the pending (Partial) gradients before the optimizer step (tp/partial_grads.h).
using tp::reduce_partial_grads;

// ---- loss ----

/// Mean cross entropy over all tokens of logits (B, S, V) against targets (B, S) int64.
/// Plain logits: at::cross_entropy. Vocab-sharded DTensor logits:
/// tp::vocab_parallel_cross_entropy (3 all_reduces of B*S values forward, none backward; its
/// backward needs no guard).
/// Returns a plain 0-d tensor equal on every rank.
at::Tensor token_cross_entropy(const at::Tensor& logits, const at::Tensor& targets);

/// The loss of this rank's slots under context parallelism (cp ranks, dtensor/cp/
/// context_parallel.h): cross entropy of its logits (B, n, V) against its targets (B, n)
/// (layout.shard of the batch's, padding -100) summed over the targets other than -100 (padding,
/// a packed document's last token), times cp / `tokens`, the number of such targets in the
/// whole batch (or this rank's data-parallel slice of it). Its mean over the cp ranks - which
/// parallelize averages the gradients over - is one device's token_cross_entropy of the batch.
/// Plain or vocab-sharded logits, as token_cross_entropy.
at::Tensor context_parallel_loss(const at::Tensor& logits, const at::Tensor& targets, int64_t cp,
                                 int64_t tokens);

/// token_cross_entropy + backward; returns the detached loss.
at::Tensor loss_and_backward(const at::Tensor& logits, const at::Tensor& targets);

/// The training loss of `model`'s last forward, which gave `logits`: token_cross_entropy plus,
/// with sparse blocks, router_aux_loss_coef times model.aux_loss() (transformers' loss with
/// output_router_logits). `data_parallel`: as TransformerImpl::aux_loss (the cross entropy stays
/// this rank's mean, which the gradients' average over the ranks makes the batch's).
at::Tensor training_loss(const TransformerImpl& model, const at::Tensor& logits,
                         const at::Tensor& targets,
                         const std::optional<DeviceMesh>& data_parallel = std::nullopt);

}  // namespace dtensor::models
