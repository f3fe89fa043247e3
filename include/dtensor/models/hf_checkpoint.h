#pragma once
// Hugging Face decoder checkpoints (a `save_pretrained` directory of LlamaForCausalLM,
// Qwen3ForCausalLM, Qwen2ForCausalLM, MistralForCausalLM or Gemma3ForCausalLM: config.json and
// model.safetensors, or shards listed in model.safetensors.index.json) loaded into our decoder,
// whole or tensor-parallel (the families and what each config key means: docs/ARCHITECTURE.md, "One
// decoder, many families"):
//
//   auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
//   auto hf = load_hf("Llama-3.2-1B", mesh, {.dtype = at::kFloat});
//   at::Tensor logits = hf.model->forward(tokens);  // vocab-sharded DTensor under loss parallel
//   // hf.config: the DecoderConfig; hf.stats.bytes_read: what this rank read
//
// Shard-on-read: each rank copies out of the (memory-mapped) files only the bytes of the slices
// its parameters keep under the TP plan (apply_tensor_parallel), so it reads about
// (sharded bytes) / tp + (replicated bytes): norms, and wk/wv where KV heads are replicated.
// load_hf allocates no more than that either: the model is built on the meta device
// (meta_init.h), cut by the plan, and the slices read become its parameters.
// Parameter names map from HF's ("model.layers.0.self_attn.q_proj.weight") to ours
// ("layers.0.attention.wq.weight"); q/k rows (and q/k biases and norm weights) are permuted from
// HF's rotate-half order to the interleaved pairs our rotary embedding uses; any floating source
// dtype is cast to the model's.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/transformer.h"

namespace dtensor::models {

/// What config.json says beyond DecoderConfig.
struct HfConfig {
  DecoderConfig config;
  /// torch_dtype (transformers 4) or dtype (5): the dtype of the stored weights as saved.
  c10::ScalarType dtype = c10::ScalarType::Float;
  /// The family config.json names ("Qwen3ForCausalLM"; see docs/ARCHITECTURE.md, "One decoder,
  /// many families").
  std::string architecture = "LlamaForCausalLM";
};

/// Reads `dir`/config.json of LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
/// MistralForCausalLM or Gemma3ForCausalLM: hidden_size, num_hidden_layers, num_attention_heads,
/// num_key_value_heads, intermediate_size, head_dim (any even size), attention_bias, sliding_window
/// with layer_types or the family's rule (use_sliding_window and max_window_layers for Qwen),
/// rope_theta and rope_scaling (transformers 4) or rope_parameters (5) of type "default" or
/// "llama3", rms_norm_eps, vocab_size, tie_word_embeddings, max_position_embeddings (our
/// max_seq_len) and torch_dtype; for Gemma 3 also query_pre_attn_scalar, hidden_activation,
/// final_logit_softcapping and the rotary base of each layer type
/// (rope_parameters.{full,sliding}_attention, or rope_theta and rope_local_base_freq), sliding
/// layers by layer_types or sliding_window_pattern. Throws naming the file, the key and its value
/// for an unsupported architecture, rope type, activation, layer type or a feature that is not
/// built (mixture of experts, MLP biases, attention soft-capping, ...).
HfConfig read_hf_config(const std::string& dir);
/// read_hf_config of a config.json's text; `source` names it in the errors (as the path does).
HfConfig hf_config_from_json(const std::string& text, const std::string& source);

struct HfLoadOptions {
  std::optional<c10::ScalarType> dtype;  // the model's dtype; default: config.json's
  std::optional<int64_t> max_seq_len;    // rotary table length; default: max_position_embeddings
  TensorParallelOptions tp;              // the plan's options when a mesh is given
};

struct HfLoadStats {
  uint64_t bytes_read = 0;        // bytes this rank copied out of the checkpoint files
  uint64_t checkpoint_bytes = 0;  // bytes of all the tensors this model uses, in the files
  int64_t tensors = 0;            // checkpoint tensors this rank read from
  int64_t files = 0;              // safetensors files opened
};

struct HfModel {
  DecoderConfig config;
  Transformer model{nullptr};
  HfLoadStats stats;
};

/// Builds the model from config.json in options.dtype (or the checkpoint's) on the meta device,
/// parallelizes it over `mesh` when given (apply_tensor_parallel, no communication), and makes
/// the slices it reads this rank's parameters: a rank never holds the whole model.
/// Every rank calls it; no collective is issued, and every rank fails alike on bad input.
HfModel load_hf(const std::string& dir, const std::optional<DeviceMesh>& mesh = std::nullopt,
                const HfLoadOptions& options = {});

/// Loads the checkpoint in `dir` into an existing model (plain or parallelized, any dtype). All
/// files, names, shapes and dtypes are checked and this rank's slices read before any parameter
/// changes: on error (naming the file and tensor) the model is left as it was. Parameters on
/// the meta device (other pipeline stages', see materialize_stages) are checked, not read.
HfLoadStats load_hf_weights(const std::string& dir, TransformerImpl& model);

struct HfSaveOptions {
  std::optional<c10::ScalarType> dtype;  // of the stored weights; default: the model's
  /// The family written ("MistralForCausalLM"); default: the first of Llama, Qwen3, Qwen2,
  /// Mistral, Gemma3 that expresses the configuration (Llama when it has no family feature).
  std::optional<std::string> architecture;
};

/// Writes `dir`/config.json and `dir`/model.safetensors (metadata {"format": "pt"}) that
/// transformers' from_pretrained (the family's ForCausalLM class) loads unchanged: HF names, q/k
/// rows back in rotate-half order, no lm_head when the embedding is tied. Collective, from any TP
/// degree and FSDP sharding: every rank calls it, parameters are gathered with full_tensor (FSDP's
/// leaves are DTensors too), global rank 0 writes (the
/// safetensors file atomically) and every rank throws if rank 0 failed.
void save_hf(const std::string& dir, const TransformerImpl& model,
             const HfSaveOptions& options = {});

/// The Hugging Face name of one of our parameter names ("tok_embeddings.weight" ->
/// "model.embed_tokens.weight") in a model with `config`, whose post_norms decide which HF norm
/// ffn_norm is (Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm); throws for
/// names that have none.
std::string hf_parameter_name(const std::string& name, const DecoderConfig& config = {});

}  // namespace dtensor::models
