#pragma once
// The mixture-of-experts part of a Hugging Face config.json (Qwen3-MoE, Mixtral, gpt-oss): the
// routing, the experts' width, which layers are sparse and where the checkpoint keeps the
// experts.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/models/hf_experts.h"
#include "dtensor/models/moe.h"

namespace dtensor::models {

/// The mixture-of-experts part of a Hugging Face config.json.
struct HfMoeConfig {
  MoeOptions options;
  int64_t expert_hidden_dim = 0;    // each expert's I: moe_intermediate_size or intermediate_size
  std::vector<bool> sparse_layers;  // which layers hold experts (the others a dense MLP)
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;
  HfExpertLayout layout = kQwen3MoeExperts;
};

/// The mixture-of-experts configuration `dir`/config.json gives: Qwen3MoeForCausalLM
/// (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
/// mlp_only_layers), MixtralForCausalLM (num_local_experts, num_experts_per_tok,
/// intermediate_size, router_jitter_noise 0), GptOssForCausalLM (num_local_experts,
/// num_experts_per_tok, intermediate_size, swiglu_alpha, swiglu_limit, quantization_config of
/// quant_method "mxfp4"), each with router_aux_loss_coef and output_router_logits; nullopt for
/// another architecture. Throws naming the file, the key and its value for what is not built:
/// shared experts, group-limited routing, multi-head latent attention, linear-attention layers,
/// a router type other than softmax top-k, router jitter, num_experts_per_tok above the experts.
std::optional<HfMoeConfig> read_hf_moe_config(const std::string& dir);

}  // namespace dtensor::models
