#pragma once
// How the mixture-of-experts families store a sparse layer's experts in a Hugging Face
// checkpoint, and our stacked expert parameters (GroupedExpertsImpl: w1, w3 [E, I, H], w2
// [E, H, I], biases b1, b3 [E, I], b2 [E, H]) read from and written to them:
//   Qwen3-MoE  model.layers.L.mlp.experts.<e>.{gate_proj,up_proj,down_proj}.weight, one tensor
//              per expert, as our rows of one expert ([I, H], [I, H], [H, I]);
//   Mixtral    model.layers.L.block_sparse_moe.experts.<e>.{w1,w3,w2}.weight, likewise;
//   gpt-oss    model.layers.L.mlp.experts.gate_up_proj [E, H, 2I] (gate in the even columns, up in
//              the odd ones), gate_up_proj_bias [E, 2I] (likewise), down_proj [E, I, H],
//              down_proj_bias [E, H]; or, as published, MXFP4 gate_up_proj_blocks
//              [E, 2I, H / 32, 16] with gate_up_proj_scales [E, 2I, H / 32] and down_proj_blocks
//              [E, H, I / 32, 16] with down_proj_scales [E, H, I / 32] (biases unquantised).
// Reads take a block of a stacked parameter (this rank's shard) and touch only the bytes that
// block needs (File::slice), except gpt-oss's gate and up columns, read as one range of both.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/models/moe.h"

namespace dtensor::models {

/// Where a family keeps its experts (see above).
struct HfExpertLayout {
  const char* block;   // "mlp" or "block_sparse_moe"
  const char* router;  // the router's module: "gate" or "router"
  /// Per-expert tensor names of w1 (gate), w3 (up) and w2 (down); null when the experts are
  /// stacked as gpt-oss's.
  const char* gate;
  const char* up;
  const char* down;
};

inline constexpr HfExpertLayout kQwen3MoeExperts{"mlp", "gate", "gate_proj", "up_proj",
                                                 "down_proj"};
inline constexpr HfExpertLayout kMixtralExperts{"block_sparse_moe", "gate", "w1", "w3", "w2"};
inline constexpr HfExpertLayout kGptOssExperts{"mlp", "router", nullptr, nullptr, nullptr};

/// One of our stacked expert parameters (GroupedExpertsImpl's names).
enum class ExpertParam { kW1, kW2, kW3, kB1, kB2, kB3 };
ExpertParam expert_param(const std::string& name);  // "w1" -> kW1; throws for others
const char* expert_param_name(ExpertParam p);

/// A checkpoint's tensors by name: whether it holds one, and where (throws naming the file or
/// the index when absent).
struct HfTensorSource {
  std::function<bool(const std::string&)> has;
  std::function<std::pair<const checkpoint::safetensors::File*,
                          const checkpoint::safetensors::TensorInfo*>(const std::string&)>
      locate;
};

/// "model.layers.<layer>.<block>." of a sparse layer.
std::string hf_expert_prefix(const HfExpertLayout& layout, int64_t layer);

/// Whether sparse layer `layer`'s stacked experts are stored as MXFP4 in `source`.
bool has_mxfp4_experts(const HfTensorSource& source, const HfExpertLayout& layout, int64_t layer);

/// The names of sparse layer `layer`'s expert tensors in `source` (per expert, stacked, or MXFP4
/// blocks and scales, as stored there) for `num_experts` experts, with their biases when
/// `biases`.
std::vector<std::string> hf_expert_tensor_names(const HfTensorSource& source,
                                                const HfExpertLayout& layout, int64_t layer,
                                                int64_t num_experts, bool biases);

/// The block [offset, offset + size) of stacked parameter `p` of sparse layer `layer`, whose whole
/// shape is `shape` ([E, I, H], [E, H, I], [E, I] or [E, H]), read from `source` in the stored
/// dtype (MXFP4 dequantised to `dtype`). Checks every tensor's shape and dtype against `shape`,
/// naming the file, the tensor, both shapes and `sizes_note` (the config keys that gave `shape`).
/// Adds the bytes copied out of the files to *bytes_read.
at::Tensor read_expert_part(const HfTensorSource& source, const HfExpertLayout& layout,
                            int64_t layer, ExpertParam p, c10::IntArrayRef shape,
                            c10::IntArrayRef offset, c10::IntArrayRef size, c10::ScalarType dtype,
                            const std::string& sizes_note, uint64_t* bytes_read);

/// The Hugging Face tensors of sparse layer `layer` holding the whole stacked weights `w` (as
/// save_pretrained writes them: per expert, or gpt-oss's stacked unquantised layout).
std::vector<std::pair<std::string, at::Tensor>> hf_expert_tensors(const HfExpertLayout& layout,
                                                                  int64_t layer,
                                                                  const ExpertWeights& w);

}  // namespace dtensor::models
