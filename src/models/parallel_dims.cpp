// ParallelDims: see include/dtensor/models/parallel_dims.h.
#include "dtensor/models/parallel_dims.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <utility>

#include "dtensor/models/parallelize.h"
#include "parallel_rules.h"

namespace dtensor::models {

namespace {

// The degrees other than 1 as "pp=2 x dp_shard=2 x tp=2" (in mesh order), or "1".
std::string product_of(const ParallelDims& d, bool with_tp = true) {
  std::vector<std::string> parts;
  const std::pair<const char*, int64_t> degrees[] = {{"pp", d.pp},
                                                     {"dp_replicate", d.dp_replicate},
                                                     {"dp_shard", d.dp_shard},
                                                     {"cp", d.cp},
                                                     {"tp", d.tp}};
  for (const auto& [name, value] : degrees)
    if (value != 1 && (with_tp || std::string(name) != "tp"))
      parts.push_back(c10::str(name, "=", value));
  return parts.empty() ? "1" : c10::Join(" x ", parts);
}

// Whether the run brings a tensor-parallel plan of its own.
bool custom_plan(const ParallelizeOptions& o) { return o.tp_plan || o.tp.plan; }

// The name of the mesh dimension that plays `role`.
std::string dim_name_of(const std::string& role) {
  if (role == "dp_replicate" || role == "dp_shard") return "dp";
  return role;
}

void check_pipeline(const ParallelDims& d, const DecoderConfig& model, const TrainingOptions& run) {
  const ParallelizeOptions& o = run.parallelize;
  const PipelineOptions& p = run.pipeline;
  const std::string pp = c10::str("pipeline parallelism (pp=", d.pp, ")");
  TORCH_CHECK(!custom_plan(o), "a custom tensor-parallel plan (tp_plan) does not apply to ", pp,
              ": each stage runs the built-in plan without sequence parallelism");
  TORCH_CHECK(!o.tp.overlap_comm, "overlap_comm does not apply to ", pp,
              ": the stages run tensor parallelism without sequence parallelism, whose "
              "collectives it overlaps");
  TORCH_CHECK(p.schedule == "gpipe" || p.schedule == "1f1b" || p.schedule == "interleaved",
              "unknown pipeline schedule '", p.schedule, "': expected gpipe, 1f1b or interleaved");
  TORCH_CHECK(p.virtual_stages >= 1, "virtual_stages must be at least 1, got ", p.virtual_stages);
  TORCH_CHECK(p.virtual_stages == 1 || p.schedule == "interleaved",
              "virtual_stages=", p.virtual_stages,
              " (stages per rank) needs the interleaved schedule, not ", p.schedule);
  const int64_t stages = d.pp * p.virtual_stages;
  TORCH_CHECK(model.n_layers >= stages, pp,
              " needs at least one block per stage, but the model has ", model.n_layers,
              " layers for ", stages, " stages",
              p.virtual_stages > 1 ? c10::str(" (virtual_stages=", p.virtual_stages, ")") : "");
  TORCH_CHECK(p.microbatches >= 1, "microbatches must be at least 1, got ", p.microbatches);
  if (const int64_t rounds = std::max<int64_t>(1, p.microbatches / d.pp);
      p.schedule == "interleaved" && p.microbatches % rounds != 0) {
    TORCH_CHECK(false, "the interleaved schedule runs micro-batches in rounds of about pp=", d.pp,
                " ranks: use microbatches a multiple of ", d.pp, " or below ", 2 * d.pp, ", not ",
                p.microbatches);
  }
  if (run.batch_size > 0) {
    TORCH_CHECK(run.batch_size % (d.dp() * p.microbatches) == 0, "the batch of ", run.batch_size,
                " rows does not split into ",
                d.dp() > 1 ? c10::str(d.dp(), " data-parallel slices of ") : "",
                "microbatches=", p.microbatches, " equal micro-batches");
  }
}

// What ops::LayoutInvariantMode covers so far: TP of a degree dividing P, FSDP over up to
// kLayoutInvariantBatchSegments ranks, pipeline stages (one per rank).
void check_layout_invariant(const ParallelDims& d, const DecoderConfig& m,
                            const TrainingOptions& run) {
  const int64_t p = run.layout_invariant;
  const std::string mode = c10::str("the layout-invariant mode (P=", p, ")");
  TORCH_CHECK(p > 0 && (p & (p - 1)) == 0, mode,
              ": P is the number of canonical segments each sum is cut into: a power of two "
              "(e.g. 4, for the same bits at TP 1, 2 and 4)");
  const int64_t segments = kLayoutInvariantBatchSegments;
  TORCH_CHECK(d.dp_replicate == 1, mode, " covers tensor parallelism, FSDP (dp_shard) up to ",
              segments,
              " ranks and pipeline stages: plain data parallelism's all-reduce (dp_replicate=",
              d.dp_replicate, ") is not canonical yet");
  TORCH_CHECK(segments % d.dp_shard == 0, mode, " covers FSDP (dp_shard) up to ", segments,
              " ranks: each batch is cut into ", segments,
              " segments, and FSDP's sum of dp_shard=", d.dp_shard,
              " ranks' gradients is not canonical yet");
  TORCH_CHECK(!run.parallelize.fsdp.param_dtype, mode,
              " computes in float32 (or float64): drop FSDP's mixed precision (param_dtype)");
  TORCH_CHECK(run.batch_size == 0 || run.batch_size % segments == 0, mode, " cuts each batch into ",
              segments, " segments: the batch of ", run.batch_size,
              " rows does not divide into them");
  TORCH_CHECK(p % d.tp == 0, mode, ": the TP degree ", d.tp,
              " must divide P (each rank takes P / tp of the segments)");
  TORCH_CHECK(!run.parallelize.tp.overlap_comm, mode,
              " does not combine with overlap_comm, which splits the blocks' products its own way");
  if (d.tp > 1) {
    const std::string at_tp = c10::str(mode, " at tp=", d.tp, ": ");
    TORCH_CHECK(m.kv_heads() % d.tp == 0, at_tp, "the model's ", m.kv_heads(),
                " KV heads are replicated over the TP ranks, whose sum of their gradients is not "
                "canonical yet: use a TP degree that divides n_kv_heads");
    const std::pair<const char*, int64_t> columns[] = {{"wq", m.n_heads * m.head_dim()},
                                                       {"wk and wv", m.kv_heads() * m.head_dim()},
                                                       {"w1 and w3", m.hidden_dim()},
                                                       {"output", m.vocab_size}};
    for (const auto& [name, width] : columns)
      TORCH_CHECK(width / d.tp >= 16, at_tp, "the ", name, " projection's column shards are ",
                  width / d.tp,
                  " wide; the mode needs 16 or more (narrower products take another kernel path "
                  "in this LibTorch): use a smaller TP degree or a wider model");
  }
  if (d.pp > 1) {
    // The schedule's micro-batches are the batch segments one dp_shard rank holds.
    const int64_t mb = segments / d.dp_shard;
    TORCH_CHECK(run.pipeline.microbatches == mb, mode, " runs the batch's ", segments,
                " segments as the micro-batches",
                d.dp_shard > 1 ? c10::str(" of the ", d.dp_shard, " dp_shard ranks") : "",
                ": microbatches must be ", mb, ", not ", run.pipeline.microbatches);
    TORCH_CHECK(run.pipeline.virtual_stages == 1, mode,
                " runs one stage per rank: use the 1f1b or gpipe schedule, not interleaved");
    TORCH_CHECK(!m.tie_embeddings, mode,
                " with pipeline parallelism: the model ties its embedding to its output head, "
                "whose two stages' gradients would be added in another order than one device "
                "adds them");
  }
}

// What context parallelism (src/cp) runs: the decoder's attention, dense or sliding, of any
// family but gpt-oss's sinks, over sequences of at least cp tokens.
void check_context_parallel(const ParallelDims& d, const DecoderConfig& m,
                            const TrainingOptions& run) {
  const std::string at_cp = c10::str("context parallelism (cp=", d.cp, ")");
  TORCH_CHECK(run.seq_len == 0 || run.seq_len >= d.cp, "the sequence of ", run.seq_len,
              " tokens is shorter than cp=", d.cp, ": ", at_cp,
              " gives every rank a part of each sequence");
  TORCH_CHECK(!m.attention_sinks, at_cp,
              " does not support attention sinks (gpt-oss): the blocks' merge has no sink logit");
  TORCH_CHECK(!m.has_moe(), at_cp,
              " with mixture-of-experts layers is not built yet (routing statistics and the "
              "auxiliary loss span the cp ranks)");
  TORCH_CHECK(run.layout_invariant == 0, at_cp,
              " does not combine with the layout-invariant mode (a query's bits would depend on "
              "how its keys are cut into blocks)");
  TORCH_CHECK(m.dropout == 0, at_cp,
              " does not combine with residual dropout, whose masks are keyed by whole sequences");
  // Sequence parallelism splits each rank's slots over tp: both layouts then give cp equal
  // parts of seq_len / cp slots.
  const bool sequence_parallel = d.tp > 1 && run.parallelize.tp.sequence_parallel;
  TORCH_CHECK(!sequence_parallel || run.seq_len == 0 || run.seq_len % (2 * d.cp * d.tp) == 0, at_cp,
              " with sequence parallelism (tp=", d.tp, ") needs a sequence length ",
              "divisible by 2 x cp x tp = ", 2 * d.cp * d.tp,
              " (each rank's slots split over tp), ", "got ", run.seq_len,
              "; or turn sequence parallelism off");
}

}  // namespace

namespace detail {

void check_sequence_parallel_length(int64_t seqlen, int64_t tp) {
  TORCH_CHECK(seqlen % tp == 0, "sequence length ", seqlen, " is not divisible by tp=", tp,
              ": sequence parallelism keeps equal sequence shards as plain local tensors; pad "
              "the batch to a multiple of ",
              tp, " or turn sequence parallelism off (sequence_parallel=false)");
}

void check_dropout_without_sequence_parallel(double dropout) {
  TORCH_CHECK(dropout == 0,
              "residual dropout keys its masks by whole sequences, but sequence parallelism gives "
              "each rank a slice of them; turn sequence parallelism off (sequence_parallel=false) "
              "or set DecoderConfig::dropout to 0");
}

void check_overlap_comm(const DecoderConfig& config, int64_t tp,
                        const TensorParallelOptions& options) {
  TORCH_CHECK(options.sequence_parallel,
              "overlap_comm overlaps the built-in plan's sequence-parallel all-gathers and "
              "reduce-scatters, so it needs sequence_parallel=true; set overlap_comm=false or "
              "enable sequence parallelism");
  TORCH_CHECK(config.kv_heads() % tp == 0,
              "overlap_comm needs wk/wv ColwiseParallel, i.e. n_kv_heads divisible by tp; got "
              "n_kv_heads=",
              config.kv_heads(), " and tp=", tp,
              ". Set overlap_comm=false or use a tp degree that divides n_kv_heads");
  TORCH_CHECK(!config.qkv_bias && !config.wo_bias,
              "overlap_comm multiplies by the projection weights alone; the config has attention "
              "biases (qkv_bias/wo_bias). Set overlap_comm=false");
  TORCH_CHECK(options.overlap_chunks >= 1, "overlap_chunks must be at least 1, got ",
              options.overlap_chunks);
}

}  // namespace detail

const std::vector<std::string>& ParallelDims::roles() {
  static const std::vector<std::string> names{"pp", "dp", "dp_replicate", "dp_shard", "cp",
                                              "tp", "ep"};
  return names;
}

ParallelDims ParallelDims::resolved() const {
  ParallelDims d = *this;
  TORCH_CHECK(d.world_size >= 1, "ParallelDims: world_size must be at least 1, got ", world_size);
  const std::pair<const char*, int64_t*> degrees[] = {{"pp", &d.pp},
                                                      {"dp_replicate", &d.dp_replicate},
                                                      {"dp_shard", &d.dp_shard},
                                                      {"cp", &d.cp},
                                                      {"tp", &d.tp}};
  const char* rest_name = nullptr;
  int64_t* rest = nullptr;
  int64_t known = 1;
  for (const auto& [name, value] : degrees) {
    if (*value != -1) {
      known *= std::max<int64_t>(*value, 1);
      continue;
    }
    TORCH_CHECK(!rest, "ParallelDims: only one degree may be -1 (the ranks the others leave); ",
                rest_name, " and ", name, " are");
    rest_name = name;
    rest = value;
  }
  if (rest) {
    *rest = 1;
    const std::string others = product_of(d);
    TORCH_CHECK(d.world_size % known == 0, others,
                others.find(" x ") == std::string::npos ? std::string() : c10::str(" = ", known),
                " does not divide the ", d.world_size, " ranks; ", rest_name,
                " (-1) is the ranks the others leave");
    *rest = d.world_size / known;
  }
  d.validate();
  return d;
}

void ParallelDims::validate() const {
  const std::pair<const char*, int64_t> degrees[] = {{"dp_replicate", dp_replicate},
                                                     {"dp_shard", dp_shard},
                                                     {"cp", cp},
                                                     {"tp", tp},
                                                     {"pp", pp},
                                                     {"ep", ep}};
  for (const auto& [name, value] : degrees)
    TORCH_CHECK(value >= 1, "ParallelDims: ", name, " must be at least 1, got ", value,
                value == -1 ? " (resolve it first: ParallelDims::resolved)" : "");
  const int64_t product = pp * dp_replicate * dp_shard * cp * tp;
  TORCH_CHECK(product == world_size, product_of(*this), " = ", product,
              " ranks, but world_size is ", world_size);
  TORCH_CHECK(dp_replicate == 1 || dp_shard == 1, "dp_replicate=", dp_replicate,
              " with dp_shard=", dp_shard,
              " (HSDP: replicas of FSDP groups) is not built yet; use plain data parallelism "
              "(dp_replicate) or FSDP (dp_shard)");
  // Context parallelism's gradients are averaged over "cp" (fsdp::replicate), or FSDP shards
  // over dp_shard x cp (parallelize); not yet with plain data parallelism or pipeline stages.
  TORCH_CHECK(cp == 1 || (dp_replicate == 1 && pp == 1), "context parallelism (cp=", cp, ") with ",
              product_of(*this, /*with_tp=*/false),
              " is not built yet: cp composes with tensor parallelism (tp) and FSDP (dp_shard)");
  // Experts add no ranks: they fold over the dense ranks of a stage and replica.
  TORCH_CHECK(expert_fold() % ep == 0, "expert parallelism (ep=", ep,
              ") folds over the dp_shard x cp x tp = ", expert_fold(),
              " ranks of each pipeline stage and replica, so it must divide them");
}

void ParallelDims::validate(const DecoderConfig& model, const TrainingOptions& run) const {
  validate();
  if (ep > 1) {
    TORCH_CHECK(model.has_moe(), "expert parallelism (ep=", ep,
                ") needs mixture-of-experts layers; the model has none");
    const int64_t experts = model.moe->options.num_experts;
    TORCH_CHECK(experts % ep == 0, "num_experts ", experts, " is not divisible by ep=", ep,
                " (each rank holds num_experts / ep whole experts)");
    // The decoder's plan folds it over the tp ranks (TensorParallelOptions::ep).
    TORCH_CHECK(ep == tp, "expert parallelism (ep=", ep,
                ") folds over the tp ranks only yet: ", "it must equal tp=", tp,
                " (over dp_shard and cp it is not built yet)");
    TORCH_CHECK(dp_shard == 1, "expert parallelism (ep=", ep, ") with FSDP (dp_shard=", dp_shard,
                ") is not built yet");
    TORCH_CHECK(run.parallelize.tp.ep == ep, "expert parallelism: ParallelDims has ep=", ep,
                " but the run's TensorParallelOptions::ep is ", run.parallelize.tp.ep);
  }
  const ParallelizeOptions& o = run.parallelize;
  if (pp > 1) check_pipeline(*this, model, run);
  // The load-balancing loss is a product of sums over every sparse layer's routers: no stage's
  // part adds to the loss alone, and the last stage's loss does not see the others'.
  TORCH_CHECK(pp == 1 || !model.has_moe(), "pipeline parallelism (pp=", pp,
              ") with mixture-of-experts layers is not built yet: the auxiliary "
              "(load-balancing) loss multiplies sums over every stage's routers, which no stage's "
              "loss sees; use tp and dp/dp_shard for MoE models");
  TORCH_CHECK(tp == 1 || run.layout_invariant == 0 || !model.has_moe(),
              "the layout-invariant mode at tp=", tp,
              " with mixture-of-experts layers is not built yet (it needs the experts "
              "replicated)");
  TORCH_CHECK(!o.tp.overlap_comm || (!model.has_moe() && !model.attention_sinks),
              "overlap_comm is not built for mixture-of-experts layers or attention sinks");
  TORCH_CHECK(o.fully_shard == (dp_shard > 1), "fully_shard=", o.fully_shard ? "true" : "false",
              " disagrees with dp_shard=", dp_shard,
              ": FSDP shards the parameters over the dp_shard ranks");
  TORCH_CHECK(dp_shard == 1 || !custom_plan(o),
              "a custom tensor-parallel plan (tp_plan) does not combine with FSDP (dp_shard=",
              dp_shard, ") yet");
  if (o.fsdp.param_dtype) {
    TORCH_CHECK(dp_shard > 1,
                "mixed precision (fsdp.param_dtype) is FSDP's: it needs dp_shard > 1");
    TORCH_CHECK(run.dtype == at::kFloat,
                "FSDP's mixed precision keeps float32 parameters, but they are ", run.dtype);
  }
  TORCH_CHECK(run.batch_size == 0 || run.batch_size % dp() == 0, "the batch of ", run.batch_size,
              " rows does not split over dp=", dp(), " data-parallel ranks");
  model.validate_tp(tp);
  if (cp > 1) check_context_parallel(*this, model, run);
  if (run.layout_invariant != 0) check_layout_invariant(*this, model, run);
  if (o.tp.overlap_comm) {
    TORCH_CHECK(!custom_plan(o),
                "overlap_comm overlaps the built-in plan's sequence-parallel collectives; a "
                "custom plan (tp_plan) has its own");
    detail::check_overlap_comm(model, tp, o.tp);
  }
  // Pipeline stages never shard the sequence (their boundaries carry whole activations).
  const bool sequence_parallel = tp > 1 && pp == 1 && o.tp.sequence_parallel;
  if (sequence_parallel) {
    detail::check_dropout_without_sequence_parallel(model.dropout);
    if (run.seq_len > 0) detail::check_sequence_parallel_length(run.seq_len, tp);
  }
}

DeviceMesh ParallelDims::build_mesh(const std::string& device_type) {
  validate();
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  const std::pair<const char*, int64_t> dims[] = {{"pp", pp}, {"dp", dp()}, {"cp", cp}};
  for (const auto& [name, size] : dims) {
    if (size == 1) continue;
    shape.push_back(size);
    names.emplace_back(name);
  }
  shape.push_back(tp);  // always there: the plans address it
  names.emplace_back("tp");
  world_mesh = init_device_mesh(device_type, shape, names);
  return *world_mesh;
}

std::optional<DeviceMesh> ParallelDims::mesh(const std::string& role) const {
  const auto& known = roles();
  TORCH_CHECK(std::find(known.begin(), known.end(), role) != known.end(),
              "ParallelDims::mesh: unknown role '", role, "'; roles: ", c10::Join(", ", known));
  TORCH_CHECK(world_mesh, "ParallelDims::mesh('", role,
              "'): no mesh yet; call build_mesh or make the dims with from_mesh");
  const int64_t degree = role == "pp"             ? pp
                         : role == "dp"           ? dp()
                         : role == "dp_replicate" ? dp_replicate
                         : role == "dp_shard"     ? dp_shard
                         : role == "cp"           ? cp
                         : role == "tp"           ? tp
                                                  : ep;
  // A 1-D mesh without names plays the role from_mesh gave it (every role, at one rank).
  std::optional<DeviceMesh> dim = mesh_for_role(*world_mesh, dim_name_of(role));
  if (!dim || dim->size() != degree) return std::nullopt;
  return dim;
}

ParallelDims ParallelDims::from_mesh(const DeviceMesh& mesh, bool dp_shards,
                                     const std::string& unnamed_role) {
  ParallelDims d;
  d.world_size = mesh.size();
  d.world_mesh = mesh;
  auto set = [&](const std::string& role, int64_t size) {
    if (role == "pp") d.pp = size;
    if (role == "dp") (dp_shards ? d.dp_shard : d.dp_replicate) = size;
    if (role == "dp_replicate") d.dp_replicate = size;
    if (role == "dp_shard") d.dp_shard = size;
    if (role == "cp") d.cp = size;
    if (role == "tp") d.tp = size;
  };
  if (!mesh.has_dim_names()) {
    TORCH_CHECK(mesh.ndim() == 1, "ParallelDims::from_mesh: a ", mesh.ndim(),
                "-D mesh needs dimension names to say which parallelism each is, got ", mesh.str());
    set(unnamed_role, mesh.size());
    return d;
  }
  for (int64_t i = 0; i < mesh.ndim(); ++i) set(mesh.dim_names()[i], mesh.size(i));
  // Dimensions of the caller's own names take no part in the layout.
  d.world_size = d.pp * d.dp() * d.cp * d.tp;
  return d;
}

}  // namespace dtensor::models
