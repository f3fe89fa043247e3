#pragma once
// The decoder's parameters, one row each: the one description from which the initialisation
// (TransformerImpl::init_weights), the Hugging Face names and row order (hf_families.cpp,
// hf_checkpoint.cpp, hf_save.cpp), the built-in tensor-parallel plan (decoder_plan) and the
// cached decoder (generate.cpp) are driven. A parameter a new family or block type brings is a
// row here (and its module in transformer.cpp); docs/CONTRIBUTING.md, "Recipe: add a model
// family".
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/models/transformer.h"

namespace dtensor::models::detail {

// How init_weights draws a parameter (torchtitan's initialisation), in float64.
enum class Init {
  kEmbedding,    // normal, std 1
  kProjection,   // truncated normal, std 0.02, cut at +-2
  kDepthScaled,  // truncated normal, std 0.02 / sqrt(2 (layer + 1)), cut at +-2 (output paths)
  kHead,         // truncated normal, std dim^-1/2, cut at +-3 std
  kNormScale,    // the norm's scale starts at one: 1 - norm_weight_offset
  kZeros,        // biases
};

// How tensor parallelism lays the parameter out, the plan's placement of it (what the cached
// decoder takes as this rank's part).
enum class TpPlacement {
  kRows,        // Shard(0): a column-parallel weight or bias, the vocabulary's rows
  kKvRows,      // wk/wv's rows: Shard(0) when the KV heads split over tp, else whole on every rank
                // (the replicated KV projection), of which a rank keeps its query heads' KV heads
  kColumns,     // Shard(1): a row-parallel weight
  kReplicated,  // Replicate: norms, a row-parallel bias (added once, after the sum)
  kExpertHidden,  // Shard(1): stacked experts' gate/up rows and biases, each expert's columns
  kExpertDown,    // Shard(2): stacked experts' down projections, each expert's rows
};

// The built-in plan's entry for the parameter's module (decoder_plan); kNone: none of its own
// (a bias goes with its module's weight).
enum class PlanStyle {
  kNone,
  kEmbedding,      // RowwiseParallel: vocabulary rows, output between blocks
  kNorm,           // SequenceParallel under sequence parallelism; plain without
  kPostNorm,       // SequenceParallel handing plain shards back to the residual sum; plain without
  kHead,           // ColwiseParallel on the vocabulary (the tied head: its conversions only)
  kColwise,        // ColwiseParallel
  kKvColwise,      // ColwiseParallel when the KV heads split over tp, else ReplicatedKVProjection
  kRowwise,        // RowwiseParallel, output between blocks
  kHeadNorm,       // ReplicatedHeadNorm: per-head norms of replicated weights, Partial gradients
  kHeadParameter,  // a per-query-head parameter of its module (sinks), sharded with the heads
};

// What the parameter is to the cached decoder (CachedDecoder's local weights, by role).
enum class Role {
  kEmbedding,
  kFinalNorm,
  kOutput,
  kAttentionNorm,
  kWq,
  kWk,
  kWv,
  kWo,
  kBq,
  kBk,
  kBv,
  kBo,
  kQNorm,
  kKNorm,
  kAttentionPostNorm,
  kFfnNorm,
  kW1,
  kW2,
  kW3,
  kFfnPostNorm,
  kSinks,
  kRouter,
  kRouterBias,
  kExpertW1,
  kExpertW2,
  kExpertW3,
  kExpertB1,
  kExpertB2,
  kExpertB3,
  kCount,
};

// Whether the role is one of the stacked experts' parameters, which have no single Hugging Face
// tensor (hf_experts.h reads and writes them).
inline bool is_expert_role(Role r) { return r >= Role::kExpertW1 && r <= Role::kExpertB3; }

struct ParameterRow {
  const char* name;  // ours; a block's under "layers.N."
  // Hugging Face's; a block's under "model.layers.N."; the router's after the family's expert
  // prefix (hf_experts.h); null for the stacked experts.
  const char* hf;
  const char* hf_post_norms;  // Hugging Face's with post norms (Gemma), where it differs
  // Whether the configuration has it in block `layer` (-1 for the model's own): a block type's
  // rows are present in the layers of that type.
  bool (*present)(const DecoderConfig& config, int64_t layer);
  bool rotary_rows;  // per-head rows HF keeps rotate-half, we interleaved (q/k weights, biases,
                     // norms)
  Init init;
  TpPlacement tp;
  PlanStyle plan;
  Role role;
};

// The model's own parameters (embedding, final norm, head), then those of every block, in the
// order the modules register them and the plan lists them.
const std::vector<ParameterRow>& model_parameter_rows();
const std::vector<ParameterRow>& block_parameter_rows();

// A block's sublayers whose input the plan converts as a whole before their projections
// ("attention", "feed_forward"): the path of the module, and how many positional inputs it takes
// (the first is the activation, the others pass as they are).
struct Sublayer {
  const char* path;
  int64_t inputs;
};
const std::vector<Sublayer>& block_sublayers();

// The row of our parameter `name` ("layers.3.attention.wq.weight", "norm.weight"), with the block
// index for a block's (-1 otherwise); nullopt when no row has it.
struct FoundRow {
  const ParameterRow* row;
  int64_t layer;
};
std::optional<FoundRow> find_parameter_row(const std::string& name);

// The full names of the parameters `config` has, each with its row and layer (-1: the model's),
// in registration order: every block's rows after the embedding, then the final norm and head.
struct NamedRow {
  std::string name;
  const ParameterRow* row;
  int64_t layer;
};
std::vector<NamedRow> parameter_names(const DecoderConfig& config);

}  // namespace dtensor::models::detail
