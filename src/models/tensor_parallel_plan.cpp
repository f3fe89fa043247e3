// The decoder's tensor-parallel plan (torchtitan's; docs/ARCHITECTURE.md, "The Llama plan"), the
// replicated-KV projection used when KV heads do not split over the TP ranks, and the
// pending-gradient reduction.
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/models/expert_parallel.h"
#include "dtensor/models/parallel_dims.h"
#include "dtensor/models/transformer.h"
#include "dtensor/tp/parallelize_module.h"
#include "dtensor/tp/styles.h"
#include "overlapped_plan.h"
#include "parallel_rules.h"
#include "parameter_schema.h"

namespace dtensor::models {

namespace {

// wk/wv when n_kv_heads % tp != 0: the weight stays whole (Replicate), every rank projects all
// KV heads and keeps the ones its query heads use. Which query heads a rank holds follows
// ColwiseParallel on wq: rank r has heads [r * n_heads/tp, (r+1) * n_heads/tp), and global
// query head g uses KV head g / (n_heads / n_kv_heads).
// The kept slice differs per rank, so the projection's gradient is Partial (to_local with
// grad_placements Partial): the input's gradient joins the query projection's pending sum (no
// extra collective), the weight's is summed by reduce_partial_grads.
class ReplicatedKVProjection : public tp::ParallelStyle {
 public:
  ReplicatedKVProjection(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim)
      : n_heads_(n_heads), n_kv_heads_(n_kv_heads), head_dim_(head_dim) {}

  std::string repr() const override {
    return c10::str("ReplicatedKVProjection(n_heads=", n_heads_, ", n_kv_heads=", n_kv_heads_,
                    ", head_dim=", head_dim_, ")");
  }

  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override {
    auto* linear = dynamic_cast<dtensor::nn::LinearImpl*>(&module);
    TORCH_CHECK(linear != nullptr, repr(), " at '", fqn, "' needs a dtensor::nn::Linear, got ",
                module.name());
    TORCH_CHECK(linear->weight.size(0) == n_kv_heads_ * head_dim_, repr(), " at '", fqn,
                "': weight has ", linear->weight.size(0), " rows, expected n_kv_heads * head_dim");
    TORCH_CHECK(n_heads_ % mesh.size() == 0 && n_heads_ % n_kv_heads_ == 0, repr(), " at '", fqn,
                "': n_heads must split over ", mesh.size(), " ranks and share KV heads evenly");
  }

  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override {
    validate(module, fqn, mesh);
    auto& linear = dynamic_cast<dtensor::nn::LinearImpl&>(module);
    for (const char* name : {"weight", "bias"}) {
      const at::Tensor& p = std::string(name) == "weight" ? linear.weight : linear.bias;
      if (p.defined())
        replace_parameter(linear, name,
                          distribute_tensor(p.detach(), mesh, {Replicate()}, src_data_rank));
    }
    // The projection runs on local tensors: the input and the weight enter through to_local
    // with Partial gradients, so backward hands pending sums on (the input's joins the query
    // projection's, the weight's is summed by reduce_partial_grads) instead of letting a
    // DTensor matmul reduce-scatter a Partial output gradient. The module's weight member is
    // swapped for the local view during the call and restored after it.
    linear.register_forward_pre_hook([mesh](torch::nn::Module& m, tp::ModuleCall& call) {
      auto& self = dynamic_cast<dtensor::nn::LinearImpl&>(m);
      at::Tensor x = call.args.at(0).toTensor();
      if (!is_dtensor(x)) x = from_local(x, mesh, {Replicate()});
      if (!spec_of(x).is_replicated()) x = redistribute(x, mesh, {Replicate()});
      call.args[0] = to_local(x, std::vector<Placement>{Partial()});
      self.weight = to_local(registered(self, "weight"), std::vector<Placement>{Partial()});
      if (self.bias.defined())
        self.bias = to_local(registered(self, "bias"), std::vector<Placement>{Partial()});
    });
    const at::Tensor index =
        kv_heads_of_rank(n_heads_, n_kv_heads_, mesh.get_local_rank(), mesh.size());
    const int64_t n_kv = n_kv_heads_, head_dim = head_dim_;
    linear.register_forward_hook(
        [index, n_kv, head_dim](torch::nn::Module& m, const tp::ModuleCall&, c10::IValue& out) {
          auto& self = dynamic_cast<dtensor::nn::LinearImpl&>(m);
          self.weight = registered(self, "weight");
          if (self.bias.defined()) self.bias = registered(self, "bias");
          const at::Tensor local = out.toTensor();
          out = local.unflatten(-1, {n_kv, head_dim})
                    .index_select(-2, index.to(local.device()))
                    .flatten(-2);
        });
  }

  static at::Tensor registered(torch::nn::Module& m, const char* name) {
    return *m.named_parameters(/*recurse=*/false).find(name);
  }

 private:
  int64_t n_heads_, n_kv_heads_, head_dim_;
};

// q_norm / k_norm (one head's width): every rank normalises its own heads with the same weight,
// so the weight is replicated; attention takes its local value with a Partial gradient
// (transformer.cpp's norm_weight), which reduce_partial_grads sums over the group.
class ReplicatedHeadNorm : public tp::ParallelStyle {
 public:
  std::string repr() const override { return "ReplicatedHeadNorm()"; }

  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh&) const override {
    TORCH_CHECK(dynamic_cast<dtensor::nn::RMSNormImpl*>(&module) != nullptr, repr(), " at '", fqn,
                "' needs a dtensor::nn::RMSNorm, got ", module.name());
  }

  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override {
    validate(module, fqn, mesh);
    auto& norm = dynamic_cast<dtensor::nn::RMSNormImpl&>(module);
    replace_parameter(norm, "weight",
                      distribute_tensor(norm.weight.detach(), mesh, {Replicate()}, src_data_rank));
  }
};

// A per-query-head parameter of its module (attention sinks): sharded with the heads, Shard(0),
// so each rank keeps its query heads' own.
class HeadParameter : public tp::ParallelStyle {
 public:
  explicit HeadParameter(std::string name) : name_(std::move(name)) {}
  std::string repr() const override { return "HeadParameter(" + name_ + ")"; }

  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh& mesh) const override {
    const at::Tensor* p = module.named_parameters(/*recurse=*/false).find(name_);
    TORCH_CHECK(p != nullptr, repr(), " at '", fqn, "': the module has no parameter \"", name_,
                "\"");
    TORCH_CHECK(p->dim() == 1 && p->size(0) % mesh.size() == 0, repr(), " at '", fqn,
                "': one value per head, ", p->sizes(), ", does not split over ", mesh.size(),
                " ranks");
  }

  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override {
    validate(module, fqn, mesh);
    const at::Tensor p = *module.named_parameters(/*recurse=*/false).find(name_);
    replace_parameter(module, name_,
                      distribute_tensor(p.detach(), mesh, {Shard(0)}, src_data_rank)
                          .requires_grad_(p.requires_grad()));
  }

 private:
  std::string name_;
};

// A sparse layer's mixture of experts: the experts split like a dense feed-forward
// (apply_tensor_parallel of moe.h: gate/up columns and down rows per expert; router and b2
// replicated, their gradients Partial) and the block's input and output converted between the
// residual stream's layout (`between`) and the whole tensor the block takes and returns on every
// rank. Per call: forward an all-gather of the input under sequence parallelism and the block's
// all-reduce of its output; backward the all-reduce of the input's gradient and, under sequence
// parallelism, an all-gather of the output's.
class MoeParallel : public tp::ParallelStyle {
 public:
  explicit MoeParallel(Placement between) : between_(std::move(between)) {}
  std::string repr() const override { return "MoeParallel(between=" + between_.str() + ")"; }

  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh&) const override {
    TORCH_CHECK(dynamic_cast<MoEImpl*>(&module) != nullptr, repr(), " at '", fqn,
                "' needs a models::MoE, got ", module.name());
  }

  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override {
    validate(module, fqn, mesh);
    auto& moe = dynamic_cast<MoEImpl&>(module);
    apply_tensor_parallel(moe, mesh);
    const Placement between = between_;
    moe.register_forward_pre_hook([mesh, between](torch::nn::Module&, tp::ModuleCall& call) {
      at::Tensor x = call.args.at(0).toTensor();
      if (!is_dtensor(x)) x = from_local(x, mesh, {between});
      call.args[0] = to_local(redistribute(x, mesh, {Replicate()}));
    });
    moe.register_forward_hook([mesh, between](torch::nn::Module&, const tp::ModuleCall&,
                                              c10::IValue& out) {
      out =
          to_local(redistribute(from_local(out.toTensor(), mesh, {Replicate()}), mesh, {between}));
    });
  }

 private:
  Placement between_;
};

}  // namespace

at::Tensor kv_heads_of_rank(int64_t n_heads, int64_t n_kv_heads, int64_t rank, int64_t tp) {
  const int64_t local_q = n_heads / tp, n_rep = n_heads / n_kv_heads;
  std::vector<int64_t> per_query, distinct;
  for (int64_t j = 0; j < local_q; ++j) {
    per_query.push_back((rank * local_q + j) / n_rep);
    if (distinct.empty() || distinct.back() != per_query.back())
      distinct.push_back(per_query.back());
  }
  const int64_t local_kv = static_cast<int64_t>(distinct.size());
  bool uniform = local_q % local_kv == 0;
  for (int64_t j = 0; uniform && j < local_q; ++j)
    uniform = per_query[j] == distinct[j / (local_q / local_kv)];
  return at::tensor(uniform ? distinct : per_query, at::kLong);
}

std::optional<DeviceMesh> get_tp_mesh(const DeviceMesh& mesh) {
  return ParallelDims::from_mesh(mesh).mesh("tp");
}

namespace {

// Which parts of the model a plan covers: the whole model has them all, a pipeline stage some.
struct PlanParts {
  bool embedding = true;
  bool head = true;
  bool head_shares_embedding = false;  // output.weight is this module's tok_embeddings.weight
  bool layers = true;
  std::vector<int64_t> held_layers;  // the blocks present (their indices); empty: all
};

DeviceMesh tp_mesh_of(const DeviceMesh& device_mesh) {
  const std::optional<DeviceMesh> tp_mesh = get_tp_mesh(device_mesh);
  TORCH_CHECK(tp_mesh,
              "apply_tensor_parallel needs a mesh with a dimension named \"tp\" (or a 1-D mesh "
              "without names), got ",
              device_mesh.str(), " (see get_tp_mesh)");
  return *tp_mesh;
}

// The module a parameter belongs to ("attention.wq" of "attention.wq.weight").
std::string module_of(const char* parameter) {
  const std::string name = parameter;
  return name.substr(0, name.rfind('.'));
}

// What the built-in plan is made for.
struct PlanChoices {
  const DecoderConfig& config;
  int64_t tp;
  bool sp, lp;  // sequence parallelism, loss parallelism
  PlanParts parts;
  bool overlap = false;
  int64_t overlap_chunks = 2;
  int64_t ep = 1;  // expert parallelism over the tp ranks (1: experts split like feed-forwards)
  ExpertParallelOptions expert_parallel;
  // Activations between blocks: sequence shards (SP) or whole (Megatron).
  Placement between() const { return sp ? Placement(Shard(1)) : Placement(Replicate()); }
};

// The style a schema row's plan entry gives its module; nullopt: no entry.
std::optional<tp::Style> row_style(const PlanChoices& c, detail::PlanStyle style) {
  using namespace tp;
  using detail::PlanStyle;
  switch (style) {
    case PlanStyle::kNone:
      return std::nullopt;
    case PlanStyle::kEmbedding:
      return RowwiseParallel({.input_layouts = Replicate(), .output_layouts = c.between()});
    case PlanStyle::kNorm:
      if (!c.sp) return std::nullopt;
      return SequenceParallel();
    case PlanStyle::kPostNorm:
      // Post norms take the sequence shards wo and w2 reduce-scatter to and hand plain shards
      // back to the residual sum; without SP they run whole, as the other norms.
      if (!c.sp) return std::nullopt;
      return SequenceParallel({.use_local_output = true});
    case PlanStyle::kHead: {
      const Placement logits = c.lp ? Placement(Shard(-1)) : Placement(Replicate());
      if (c.overlap)
        return detail::overlapped_head(c.overlap_chunks, c.lp, c.parts.head_shares_embedding);
      if (c.parts.head_shares_embedding) {
        // output.weight is tok_embeddings.weight (Shard(0), vocab rows, once that is sharded):
        // the head keeps only ColwiseParallel's input and output conversions.
        return PrepareModuleInputOutput({
            .input_layouts = Layouts{c.between()},
            .desired_input_layouts = Layouts{Replicate()},
            .output_layouts = Layouts{Shard(-1)},
            .desired_output_layouts = Layouts{logits},
            .use_local_output = !c.lp,
        });
      }
      return ColwiseParallel(
          {.input_layouts = c.between(), .output_layouts = logits, .use_local_output = !c.lp});
    }
    case PlanStyle::kColwise:
      return ColwiseParallel();
    case PlanStyle::kKvColwise: {
      const DecoderConfig& m = c.config;
      if (m.kv_heads() % c.tp == 0) return ColwiseParallel();
      return ReplicatedKVProjection(m.n_heads, m.kv_heads(), m.head_dim());
    }
    case PlanStyle::kRowwise:
      return RowwiseParallel({.output_layouts = c.between()});
    case PlanStyle::kHeadNorm:
      return ReplicatedHeadNorm();
    case PlanStyle::kHeadParameter:
      return std::nullopt;  // decoder_plan names the parameter
  }
  return std::nullopt;
}

// A sublayer's input conversion: one for all its projections (wq, wk and wv: their three input
// gradients then meet in one all_reduce instead of three, without SP too). With overlap the
// sublayer gathers its sequence-sharded input itself, piece by piece.
tp::Style sublayer_style(const PlanChoices& c, const detail::Sublayer& sub) {
  if (sub.path == std::string("moe")) {
    if (c.ep == 1) return MoeParallel(c.between());
    ExpertParallelOptions o = c.expert_parallel;
    o.tokens = c.sp ? ExpertTokens::kSequenceShard : ExpertTokens::kReplicated;
    return ExpertParallel(o);
  }
  if (c.overlap) {
    return sub.path == std::string("attention") ? detail::overlapped_attention(c.overlap_chunks)
                                                : detail::overlapped_feed_forward(c.overlap_chunks);
  }
  tp::Layouts in{c.between()}, desired{Replicate()};
  for (int64_t i = 1; i < sub.inputs; ++i) {
    in.push_back(std::nullopt);
    desired.push_back(std::nullopt);
  }
  return tp::PrepareModuleInput({.input_layouts = in, .desired_input_layouts = desired});
}

// The built-in plan, from the parameter schema (parameter_schema.h): each parameter's module gets
// the style its row names, and a block's sublayer its input conversion before its first
// projection.
tp::ParallelizePlan decoder_plan(const PlanChoices& c) {
  tp::ParallelizePlan plan;
  for (const detail::ParameterRow& row : detail::model_parameter_rows()) {
    const bool embedding = row.plan == detail::PlanStyle::kEmbedding;
    if (embedding ? !c.parts.embedding : !c.parts.head) continue;
    if (auto style = row_style(c, row.plan)) plan.emplace_back(module_of(row.name), *style);
  }
  if (!c.parts.layers) return plan;
  std::vector<int64_t> held = c.parts.held_layers;
  if (held.empty())
    for (int64_t l = 0; l < c.config.n_layers; ++l) held.push_back(l);
  std::vector<std::string> converted;
  for (const detail::ParameterRow& row : detail::block_parameter_rows()) {
    // The blocks that have it (a block type's rows are in its blocks only): all of them as
    // "layers.*", else each by its index, so that no entry names a module a block lacks.
    std::vector<std::string> prefixes;
    for (const int64_t l : held)
      if (row.present(c.config, l)) prefixes.push_back("layers." + std::to_string(l) + ".");
    if (prefixes.empty()) continue;
    if (prefixes.size() == held.size()) prefixes = {"layers.*."};
    const std::string module = module_of(row.name);
    for (const std::string& prefix : prefixes) {
      for (const detail::Sublayer& sub : detail::block_sublayers()) {
        const std::string path = prefix + sub.path;
        if (module.rfind(std::string(sub.path) + ".", 0) != 0 ||
            std::find(converted.begin(), converted.end(), path) != converted.end())
          continue;
        plan.emplace_back(path, sublayer_style(c, sub));
        converted.push_back(path);
      }
      if (row.plan == detail::PlanStyle::kHeadParameter) {
        const std::string name = row.name;
        plan.emplace_back(prefix + module, HeadParameter(name.substr(module.size() + 1)));
      } else if (auto style = row_style(c, row.plan)) {
        plan.emplace_back(prefix + module, *style);
      }
    }
  }
  return plan;
}

}  // namespace

void apply_tensor_parallel(TransformerImpl& model, const DeviceMesh& device_mesh,
                           TensorParallelOptions options) {
  const DeviceMesh mesh = tp_mesh_of(device_mesh);
  for (const auto& p : model.parameters())
    TORCH_CHECK(!is_dtensor(p), "apply_tensor_parallel: the model is already parallelized",
                model.is_pipeline_stage() ? c10::str(" (pipeline stage ", model.stage_index(), ")")
                                          : std::string());
  const DecoderConfig& config = model.config();
  config.validate_tp(mesh.size());
  // A pipeline stage's activations cross its boundaries whole: sequence parallelism would leave
  // sequence-sharded DTensors there.
  const bool stage = model.is_pipeline_stage();
  const bool sp = options.sequence_parallel && !stage, lp = options.loss_parallel;
  if (options.overlap_comm) {
    TORCH_CHECK(!stage, "apply_tensor_parallel: pipeline stage ", model.stage_index(),
                ": overlap_comm needs sequence parallelism, which pipeline stages do not use; set "
                "overlap_comm=false");
    TORCH_CHECK(!options.plan,
                "apply_tensor_parallel: overlap_comm overlaps the built-in plan's "
                "collectives; a plan of your own has its own");
    TORCH_CHECK(!config.has_moe() && !config.attention_sinks,
                "apply_tensor_parallel: overlap_comm is not built for mixture-of-experts blocks "
                "or attention sinks; set overlap_comm=false");
    try {
      detail::check_overlap_comm(config, mesh.size(), options);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "apply_tensor_parallel: ", e.msg());
    }
  }
  PlanParts parts;
  parts.embedding = !model.tok_embeddings.is_empty();
  parts.head = !model.output.is_empty();
  parts.head_shares_embedding = parts.embedding && parts.head && config.tie_embeddings;
  parts.layers = !model.layers->empty();
  for (const TransformerBlockImpl* block : model.blocks())
    parts.held_layers.push_back(block->layer_id);
  TORCH_CHECK(options.ep == 1 || options.ep == mesh.size(),
              "apply_tensor_parallel: ep=", options.ep, " must be 1 or the tp degree ", mesh.size(),
              " (expert parallelism folds over the tp ranks)");
  TORCH_CHECK(options.ep == 1 || !options.plan,
              "apply_tensor_parallel: ep > 1 is the built-in plan's; a plan of your own says "
              "its own styles");
  TORCH_CHECK(
      options.ep == 1 || (config.has_moe() && config.moe->options.num_experts % options.ep == 0),
      "apply_tensor_parallel: ep=", options.ep, " needs mixture-of-experts layers whose ",
      "num_experts divides by it, got ", config.has_moe() ? config.moe->options.num_experts : 0,
      " experts");
  const PlanChoices choices{config,
                            mesh.size(),
                            sp,
                            lp,
                            parts,
                            options.overlap_comm,
                            options.overlap_chunks,
                            options.ep,
                            options.expert_parallel};
  tp::parallelize_module(model, mesh, options.plan ? *options.plan : decoder_plan(choices),
                         options.src_data_rank);
  if (parts.head_shares_embedding) model.tie_output_to_embedding();
  // The checks of sequence parallelism, where the plan meets its input.
  if (sp && parts.embedding) {
    const int64_t tp = mesh.size();
    model.register_forward_pre_hook([tp](torch::nn::Module& m, tp::ModuleCall& call) {
      const at::Tensor& tokens = call.args.at(0).toTensor();
      if (tokens.dim() == 2) detail::check_sequence_parallel_length(tokens.size(1), tp);
      if (m.is_training())
        detail::check_dropout_without_sequence_parallel(
            dynamic_cast<TransformerImpl&>(m).config().dropout);
    });
  }
}

tp::ParallelizePlan tensor_parallel_plan(const DecoderConfig& config, int64_t tp,
                                         const TensorParallelOptions& options) {
  PlanParts parts;
  parts.head_shares_embedding = config.tie_embeddings;
  parts.layers = config.n_layers > 0;
  return decoder_plan({config, tp, options.sequence_parallel, options.loss_parallel, parts,
                       options.overlap_comm, options.overlap_chunks, options.ep,
                       options.expert_parallel});
}

}  // namespace dtensor::models
