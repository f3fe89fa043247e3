// The decoder's tensor-parallel plan (torchtitan's; docs/ARCHITECTURE.md, "The Llama plan"), the
// replicated-KV projection used when KV heads do not split over the TP ranks, and the
// pending-gradient reduction.
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/models/transformer.h"
#include "dtensor/models/transformer_stage.h"
#include "dtensor/tp/parallelize_module.h"
#include "dtensor/tp/styles.h"

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
  if (mesh.ndim() == 1) return mesh;
  for (const auto& name : mesh.dim_names())
    if (name == "tp") return mesh["tp"];
  return std::nullopt;
}

namespace {

// Which parts of the model a plan covers: the whole model has them all, a pipeline stage some.
struct PlanParts {
  bool embedding = true;
  bool head = true;
  bool head_shares_embedding = false;  // output.weight is this module's tok_embeddings.weight
  bool layers = true;
};

DeviceMesh tp_mesh_of(const DeviceMesh& device_mesh) {
  const std::optional<DeviceMesh> tp_mesh = get_tp_mesh(device_mesh);
  TORCH_CHECK(tp_mesh,
              "apply_tensor_parallel needs a 1-D mesh or one with a dimension named "
              "\"tp\", got ",
              device_mesh.str(), " (see get_tp_mesh)");
  return *tp_mesh;
}

tp::ParallelizePlan decoder_plan(const DecoderConfig& config, int64_t tp, bool sp, bool lp,
                                 const PlanParts& parts, bool overlap = false) {
  using namespace tp;
  const bool kv_sharded = config.kv_heads() % tp == 0;
  auto kv_style = [&]() -> Style {
    if (kv_sharded) return ColwiseParallel();
    return ReplicatedKVProjection(config.n_heads, config.kv_heads(), config.head_dim());
  };
  // Activations between blocks: sequence shards (SP) or whole (Megatron).
  const Placement between = sp ? Shard(1) : Replicate();
  const Placement logits = lp ? Shard(-1) : Replicate();

  ParallelizePlan plan;
  if (parts.embedding) {
    plan.emplace_back("tok_embeddings",
                      RowwiseParallel({.input_layouts = Replicate(), .output_layouts = between}));
  }
  if (parts.head) {
    if (sp) plan.emplace_back("norm", SequenceParallel());
    if (parts.head_shares_embedding) {
      // output.weight is tok_embeddings.weight (Shard(0), vocab rows, once that is sharded): the
      // head keeps only ColwiseParallel's input and output conversions.
      plan.emplace_back("output", PrepareModuleInputOutput({
                                      .input_layouts = Layouts{between},
                                      .desired_input_layouts = Layouts{Replicate()},
                                      .output_layouts = Layouts{Shard(-1)},
                                      .desired_output_layouts = Layouts{logits},
                                      .use_local_output = !lp,
                                  }));
    } else {
      plan.emplace_back("output", ColwiseParallel({.input_layouts = between,
                                                   .output_layouts = logits,
                                                   .use_local_output = !lp}));
    }
  }
  if (parts.layers) {
    if (sp) plan.emplace_back("layers.*.attention_norm", SequenceParallel());
    // One conversion of the block input for wq, wk and wv together (without SP too: their
    // three input gradients then meet in one all_reduce instead of three).
    // With overlap the projections gather their sequence-sharded input themselves.
    if (!overlap) {
      plan.emplace_back(
          "layers.*.attention",
          PrepareModuleInput({.input_layouts = Layouts{between, std::nullopt},
                              .desired_input_layouts = Layouts{Replicate(), std::nullopt}}));
    }
    plan.emplace_back("layers.*.attention.wq", ColwiseParallel());
    plan.emplace_back("layers.*.attention.wk", kv_style());
    plan.emplace_back("layers.*.attention.wv", kv_style());
    plan.emplace_back("layers.*.attention.wo", RowwiseParallel({.output_layouts = between}));
    if (config.qk_norm) {
      plan.emplace_back("layers.*.attention.q_norm", ReplicatedHeadNorm());
      plan.emplace_back("layers.*.attention.k_norm", ReplicatedHeadNorm());
    }
    // Post norms take the sequence shards wo and w2 reduce-scatter to and hand plain shards back
    // to the residual sum; without SP they run whole, as the other norms.
    if (sp && config.post_norms) {
      plan.emplace_back("layers.*.attention_post_norm",
                        SequenceParallel({.use_local_output = true}));
    }
    if (sp) plan.emplace_back("layers.*.ffn_norm", SequenceParallel());
    if (!overlap) {
      plan.emplace_back("layers.*.feed_forward",
                        PrepareModuleInput({.input_layouts = Layouts{between},
                                            .desired_input_layouts = Layouts{Replicate()}}));
    }
    plan.emplace_back("layers.*.feed_forward.w1", ColwiseParallel());
    plan.emplace_back("layers.*.feed_forward.w2", RowwiseParallel({.output_layouts = between}));
    plan.emplace_back("layers.*.feed_forward.w3", ColwiseParallel());
    if (sp && config.post_norms) {
      plan.emplace_back("layers.*.ffn_post_norm", SequenceParallel({.use_local_output = true}));
    }
  }
  return plan;
}

}  // namespace

void apply_tensor_parallel(TransformerImpl& model, const DeviceMesh& device_mesh,
                           TensorParallelOptions options) {
  const DeviceMesh mesh = tp_mesh_of(device_mesh);
  TORCH_CHECK(!model.tp_state(), "apply_tensor_parallel: the model is already parallelized");
  const DecoderConfig& config = model.config();
  config.validate_tp(mesh.size());
  const bool sp = options.sequence_parallel, lp = options.loss_parallel;
  if (options.overlap_comm) {
    TORCH_CHECK(
        sp,
        "apply_tensor_parallel: overlap_comm overlaps the sequence-parallel all-gathers and "
        "reduce-scatters, so it needs sequence_parallel=true (got false); set "
        "overlap_comm=false or enable sequence parallelism");
    TORCH_CHECK(config.kv_heads() % mesh.size() == 0,
                "apply_tensor_parallel: overlap_comm needs "
                "wk/wv ColwiseParallel, i.e. n_kv_heads divisible by tp; got n_kv_heads=",
                config.kv_heads(), " and tp=", mesh.size(),
                ". Set overlap_comm=false or use a tp "
                "degree that divides n_kv_heads");
    TORCH_CHECK(!config.qkv_bias && !config.wo_bias,
                "apply_tensor_parallel: overlap_comm multiplies by the projection weights alone; "
                "the config has attention biases (qkv_bias/wo_bias). Set overlap_comm=false");
    TORCH_CHECK(options.overlap_chunks >= 1,
                "apply_tensor_parallel: overlap_chunks must be at least 1, got ",
                options.overlap_chunks);
  }
  PlanParts parts;
  parts.head_shares_embedding = config.tie_embeddings;
  parts.layers = config.n_layers > 0;
  tp::parallelize_module(model, mesh,
                         decoder_plan(config, mesh.size(), sp, lp, parts, options.overlap_comm),
                         options.src_data_rank);
  if (options.overlap_comm) {
    for (const auto& layer : *model.layers) {
      auto& block = *layer->as<TransformerBlock>();
      block.attention->overlap = OverlapComm{mesh, options.overlap_chunks};
      block.feed_forward->overlap = OverlapComm{mesh, options.overlap_chunks};
    }
  }
  if (config.tie_embeddings) model.tie_output_to_embedding();
  std::optional<int64_t> head_chunks;
  if (options.overlap_comm) head_chunks = options.overlap_chunks;
  model.set_tp_state({mesh, sp, lp, head_chunks});
}

void apply_tensor_parallel(TransformerStageImpl& stage, const DeviceMesh& device_mesh,
                           TensorParallelOptions options) {
  const DeviceMesh mesh = tp_mesh_of(device_mesh);
  TORCH_CHECK(!stage.tp_state, "apply_tensor_parallel: ", "pipeline stage ", stage.stage_index(),
              " is already parallelized");
  const DecoderConfig& config = stage.config();
  config.validate_tp(mesh.size());
  // Sequence parallelism would leave sequence-sharded DTensors at the stage boundaries.
  const bool lp = options.loss_parallel;
  TORCH_CHECK(!options.overlap_comm, "apply_tensor_parallel: pipeline stage ", stage.stage_index(),
              ": overlap_comm needs sequence parallelism, which pipeline "
              "stages do not use; set overlap_comm=false");
  PlanParts parts;
  parts.embedding = !stage.tok_embeddings.is_empty();
  parts.head = !stage.output.is_empty();
  parts.head_shares_embedding = parts.embedding && parts.head && config.tie_embeddings;
  parts.layers = !stage.layers->empty();
  tp::parallelize_module(stage, mesh, decoder_plan(config, mesh.size(), /*sp=*/false, lp, parts),
                         options.src_data_rank);
  if (parts.head_shares_embedding) stage.output->weight = stage.tok_embeddings->weight;
  stage.tp_state = TransformerImpl::TensorParallelState{mesh, false, lp};
}

}  // namespace dtensor::models
