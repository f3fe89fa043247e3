#include "trainer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <string>

#include "dtensor/ac/checkpoint.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/models/generate.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/models/meta_init.h"
#include "dtensor/nn/clip_grad.h"
#include "dtensor/util/hash.h"
#include "pipeline_part.h"

namespace dtensor::train {

DeviceMesh make_train_mesh(const RunConfig& cfg, const std::string& device_type) {
  return cfg.parallel_dims().build_mesh(device_type);
}

Trainer::Trainer(const RunConfig& config, std::optional<DeviceMesh> mesh)
    : config_(config), mesh_(std::move(mesh)) {
  if (mesh_) dims_ = models::ParallelDims::from_mesh(*mesh_, config_.fsdp);
  const models::ParallelizeOptions par = parallelize_options(config_);
  if (mesh_ && config_.pp > 1) {
    // No rank builds the whole model: it is cut as shapes, and only this rank's stages get
    // memory (the rest goes with `whole` at the end of this block).
    models::Transformer whole = models::meta_transformer(config_.model);
    whole->to(config_.dtype);
    pp_ = std::make_shared<PipelinePart>(*whole, config_, *mesh_);
  } else if (config_.meta) {
    model_ = models::meta_transformer(config_.model);  // shapes only: nothing to initialise
    model_->to(config_.dtype);
  } else {
    model_ = models::Transformer(config_.model);
    model_->to(config_.dtype);
    // Drawn from the seed alone: the TP run and the one-device check start from equal weights.
    // --hf replaces every parameter below.
    if (config_.hf_dir.empty()) model_->init_weights(config_.seed);
  }
  // --hf: each rank reads only the slices its TP plan keeps, after the plan, before FSDP shards
  // them further (the pipeline stages read theirs in PipelinePart).
  auto load_hf = [this](models::TransformerImpl& m) {
    if (!config_.hf_dir.empty() && !config_.meta) models::load_hf_weights(config_.hf_dir, m);
  };
  if (!pp_ && mesh_) {
    models::parallelize(*model_, *mesh_, par, load_hf);
  } else if (!pp_) {  // one device: plain LibTorch, checkpointed as the parallel runs are
    load_hf(*model_);
    ac::apply_ac<models::TransformerBlockImpl>(*model_, par.ac, par.ac_options);
  }
  torch::nn::Module& trained = module();

  // Decay the matrices (projections and embeddings), not the norm weights, as GPT-style
  // recipes do. A tied weight is listed (and so optimized) once.
  std::vector<at::Tensor> decay, no_decay;
  for (const at::Tensor& p : unique_parameters(trained)) {
    (p.dim() >= 2 ? decay : no_decay).push_back(p);
    params_.push_back(p);
  }
  auto options = torch::optim::AdamWOptions(config_.schedule.lr)
                     .betas({config_.beta1, config_.beta2})
                     .eps(1e-8)
                     .weight_decay(config_.weight_decay);
  auto no_decay_options = options;
  no_decay_options.weight_decay(0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(options));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(no_decay_options));
  optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(groups), options);
}

std::optional<DeviceMesh> Trainer::dp_mesh() const {
  if (!mesh_ || config_.dp == 1) return std::nullopt;
  return dims_.mesh("dp");
}

at::Tensor Trainer::dp_slice(const at::Tensor& t) const {
  const auto dp = dp_mesh();
  if (!dp) return t;
  const int64_t rows = t.size(0) / config_.dp;
  return t.narrow(0, dp->get_local_rank() * rows, rows).contiguous();
}

int64_t Trainer::dp_first_row() const {
  const auto dp = dp_mesh();
  if (!dp) return 0;
  return dp->get_local_rank() * (config_.batch_size / config_.dp);
}

models::DropoutKey Trainer::dropout_key(int64_t first_row) const {
  const uint64_t step_seed =
      config_.seed * util::kSplitMix64Gamma + static_cast<uint64_t>(step_) + 1;
  return {.seed = step_seed, .first_row = first_row, .global_rows = config_.batch_size};
}

void Trainer::record_routing() {
  const at::Tensor& aux = model_->last_aux_loss();
  if (!aux.defined() || aux.is_meta()) return;  // dtensor_plan's step has no values to read
  routing_.aux_loss = aux.item<double>();
  routing_.tokens_per_expert = model_->tokens_per_expert().cpu();
}

double Trainer::mean_over_dp(double v) const {
  const auto dp = dp_mesh();
  if (!dp) return v;
  auto t = at::full({1}, v, at::kDouble);
  return comm::all_reduce(t, ReduceOp::Sum, dp->group(0)).item<double>() /
         static_cast<double>(config_.dp);
}

std::unique_ptr<cp::ContextParallelScope> Trainer::context_parallel(const Batch& batch) const {
  if (!mesh_ || config_.cp == 1) return nullptr;
  const std::optional<DeviceMesh> cp_mesh = dims_.mesh("cp");
  TORCH_CHECK(cp_mesh, "--cp ", config_.cp, ": the mesh has no \"cp\" dimension");
  const int64_t rows = batch.inputs.size(0), seq = batch.inputs.size(1);
  cp::ContextLayout layout = batch.documents.defined()
                                 ? cp::balanced_layout(batch.documents, config_.cp)
                                 : cp::head_tail_layout(rows, seq, config_.cp);
  return std::make_unique<cp::ContextParallelScope>(cp::ContextParallel{
      std::move(layout), cp_mesh->get_group(0), cp::parse_rotate_method(config_.cp_rotate)});
}

at::Tensor Trainer::local_part(const at::Tensor& t, double pad) const {
  if (const cp::ContextParallel* c = cp::ContextParallelScope::current())
    return c->layout.shard(t, c->rank(), /*seq_dim=*/1, pad);
  return dp_slice(t);
}

at::Tensor Trainer::loss_of(const Batch& batch, const at::Tensor& logits) const {
  if (!cp::ContextParallelScope::current())
    return models::training_loss(*model_, logits, dp_slice(batch.targets), dp_mesh());
  // Each cp rank's share scaled to a mean, which the gradients' average over cp completes.
  const int64_t tokens = batch.targets.ne(-100).sum().item<int64_t>();
  return models::context_parallel_loss(logits, local_part(batch.targets, -100), config_.cp, tokens);
}

double Trainer::mean_over_cp(double v) const {
  if (!mesh_ || config_.cp == 1) return v;
  auto t = at::full({1}, v, at::kDouble);
  return comm::all_reduce(t, ReduceOp::Sum, dims_.mesh("cp")->group(0)).item<double>() /
         static_cast<double>(config_.cp);
}

// One function for every layout (FSDP shards, DTensors, plain tensors, pipeline stages).
double Trainer::clip_grad_norm(double max_norm) {
  return nn::utils::clip_grad_norm_(params_, max_norm,
                                    pp_ ? pp_->clip_options() : nn::utils::ClipGradNormOptions{});
}

models::TransformerImpl& Trainer::model() {
  TORCH_CHECK(model_, "Trainer::model(): under --pp no rank holds the whole model");
  return *model_;
}

torch::nn::Module& Trainer::module() {
  return pp_ ? pp_->stage() : static_cast<torch::nn::Module&>(*model_);
}

at::Tensor Trainer::forward_backward(const Batch& global_batch) {
  module().train();
  optimizer_->zero_grad();
  if (config_.layout_invariant > 0) return invariant_forward_backward(global_batch);
  if (pp_) {
    at::Tensor loss =
        pp_->run_schedule({dp_slice(global_batch.inputs), dp_slice(global_batch.targets)},
                          dropout_key(dp_first_row()));
    if (config_.tp > 1) models::reduce_partial_grads(pp_->stage());
    return loss;
  }
  const models::DropoutKeyScope key(dropout_key(dp_first_row()));  // backward's recomputations too
  const auto context = context_parallel(global_batch);             // and theirs
  auto logits = logits_for_loss(config_, model_->forward(local_part(global_batch.inputs)));
  // With experts: plus router_aux_loss_coef times the auxiliary loss of the whole batch (pooled
  // over dp, as one device computes it).
  at::Tensor loss = loss_of(global_batch, logits);
  loss.backward();
  loss = loss.detach();
  record_routing();
  // FSDP's backward reduce-scattered the gradients, replication's end averaged them over dp
  // (models::parallelize); what TP alone leaves pending is summed here.
  if (mesh_ && !config_.fsdp) models::reduce_partial_grads(*model_);
  return loss;
}

// --layout-invariant: the global batch is cut into kLayoutInvariantBatchSegments segments, each
// a forward and backward of its own (a dp_shard rank runs its share of them; under --pp they are
// the schedule's micro-batches), so that FSDP's sum over dp and a rank's gradient accumulation
// add the same segments' gradients: two operands, the same bits in either order. Each segment's
// loss is the mean over its tokens; the gradients' sum is divided by the segments once (FSDP's
// reduce-scatter divides by dp; the pipeline scales each micro-batch's loss by 1 / M, which a
// power of two does exactly alike).
std::vector<Batch> Trainer::invariant_segments(const Batch& global_batch) const {
  const int64_t m = kLayoutInvariantBatchSegments / config_.dp;
  const at::Tensor inputs = dp_slice(global_batch.inputs), targets = dp_slice(global_batch.targets);
  const int64_t rows = inputs.size(0) / m;
  std::vector<Batch> out;
  for (int64_t k = 0; k < m; ++k)
    out.push_back({inputs.narrow(0, k * rows, rows), targets.narrow(0, k * rows, rows)});
  return out;
}

at::Tensor Trainer::invariant_forward_backward(const Batch& global_batch) {
  const std::vector<Batch> segments = invariant_segments(global_batch);
  const auto m = static_cast<int64_t>(segments.size());
  std::vector<double> losses;  // per segment (under --pp on the last stage only)
  if (pp_) {
    pp_->run_schedule({dp_slice(global_batch.inputs), dp_slice(global_batch.targets)},
                      dropout_key(dp_first_row()));
    losses = pp_->microbatch_losses();
  } else {
    for (int64_t k = 0; k < m; ++k) {
      const Batch& b = segments[static_cast<size_t>(k)];
      const models::DropoutKeyScope key(dropout_key(dp_first_row() + k * b.inputs.size(0)));
      auto logits = logits_for_loss(config_, model_->forward(b.inputs));
      at::Tensor loss = models::training_loss(*model_, logits, b.targets);
      loss.backward();
      losses.push_back(loss.item<double>());
      record_routing();
    }
  }
  if (pp_ || !config_.fsdp) models::reduce_partial_grads(module());
  if (!pp_ && m > 1) {
    at::NoGradGuard no_grad;
    for (const auto& p : params_)
      if (p.grad().defined()) p.grad().div_(static_cast<double>(m));
  }
  if (losses.empty()) return {};
  double sum = 0;
  for (double l : losses) sum += l;
  return at::scalar_tensor(sum / static_cast<double>(m), at::kDouble);
}

std::unique_ptr<ops::LayoutInvariantMode> Trainer::layout_invariant_mode() const {
  if (config_.layout_invariant == 0) return nullptr;
  return std::make_unique<ops::LayoutInvariantMode>(config_.layout_invariant);
}

StepStats Trainer::train_step(int64_t step, const Batch& global_batch) {
  const auto invariant = layout_invariant_mode();  // backward, clipping and AdamW too
  StepStats stats;
  stats.lr = config_.schedule.at(step);
  for (auto& group : optimizer_->param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(stats.lr);
  }
  step_ = step;
  const at::Tensor loss = forward_backward(global_batch);
  const double max_norm =
      config_.grad_clip > 0 ? config_.grad_clip : std::numeric_limits<double>::infinity();
  stats.grad_norm = clip_grad_norm(max_norm);
  optimizer_->step();
  if (pp_) {
    const PipelinePart::StepResult r = pp_->step_values(loss);
    stats.loss = mean_over_dp(r.loss);
    stats.bubble = r.bubble;
  } else {
    stats.loss = mean_over_dp(mean_over_cp(loss.item<double>()));
  }
  if (routing_.tokens_per_expert.defined()) {
    stats.aux_loss = mean_over_dp(routing_.aux_loss);
    stats.tokens_per_expert = routing_.tokens_per_expert;
    if (const auto dp = dp_mesh()) {
      stats.tokens_per_expert =
          comm::all_reduce(stats.tokens_per_expert.to(at::kDouble), ReduceOp::Sum, dp->group(0))
              .to(at::kLong);
    }
  }
  return stats;
}

Trainer Trainer::gather_to_one_device() {
  TORCH_CHECK(pp_, "gather_to_one_device is for pipelined trainers (--pp)");
  Trainer one(one_device(config_), std::nullopt);
  pp_->gather_into(*optimizer_, *one.model_, *one.optimizer_);
  return one;
}

void Trainer::load_from_one_device(Trainer& one) {
  TORCH_CHECK(pp_, "load_from_one_device is for pipelined trainers (--pp)");
  pp_->scatter_from(*one.model_, *one.optimizer_, *optimizer_);
}

namespace {
int64_t local_bytes(const at::Tensor& t) {
  const at::Tensor l = is_dtensor(t) ? to_local(t) : t;
  return l.numel() * static_cast<int64_t>(l.element_size());
}
}  // namespace

int64_t Trainer::parameter_bytes_per_rank() const {
  int64_t bytes = 0;
  for (const auto& p : params_) bytes += local_bytes(p);
  return bytes;
}

StateBytes Trainer::state_bytes() const {
  StateBytes b;
  for (const auto& p : params_) {
    b.parameters += local_bytes(p);
    if (p.grad().defined()) b.gradients += local_bytes(p.grad());
    auto it = optimizer_->state().find(p.unsafeGetTensorImpl());
    if (it == optimizer_->state().end()) continue;
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    b.optimizer += local_bytes(s.exp_avg()) + local_bytes(s.exp_avg_sq());
    if (s.max_exp_avg_sq().defined()) b.optimizer += local_bytes(s.max_exp_avg_sq());
  }
  return b;
}

int64_t Trainer::state_bytes_per_rank() const {
  const StateBytes b = state_bytes();
  return b.parameters + b.gradients + b.optimizer;
}

double Trainer::evaluate(const BatchSampler& val, int64_t n_batches) {
  const auto invariant = layout_invariant_mode();
  at::NoGradGuard no_grad;
  module().eval();
  if (config_.layout_invariant > 0) {
    // Per batch segment, as the step computes the loss (see invariant_forward_backward); under
    // --pp the last stage's, then on every stage.
    std::vector<double> totals;
    for (int64_t k = 0; k < n_batches; ++k) {
      const std::vector<Batch> segments = invariant_segments(val.get(k));
      totals.resize(segments.size(), 0.0);
      for (size_t s = 0; s < segments.size(); ++s) {
        const at::Tensor out =
            pp_ ? pp_->forward(segments[s].inputs) : model_->forward(segments[s].inputs);
        if (!out.defined()) continue;
        totals[s] += models::token_cross_entropy(logits_for_loss(config_, out), segments[s].targets)
                         .item<double>();
      }
    }
    module().train();
    double local = 0;
    for (double t : totals) local += t / static_cast<double>(n_batches);
    local /= static_cast<double>(totals.size());
    return mean_over_dp(pp_ ? pp_->from_last_stage(local) : local);
  }
  double total = 0;
  for (int64_t k = 0; k < n_batches; ++k) {
    const Batch b = val.get(k);
    if (pp_) {  // the loss on the last stage, then on every rank
      const at::Tensor logits = pp_->forward(b.inputs);
      if (logits.defined()) total += models::token_cross_entropy(logits, b.targets).item<double>();
      continue;
    }
    const auto context = context_parallel(b);
    auto logits = logits_for_loss(config_, model_->forward(local_part(b.inputs)));
    total +=
        (context ? loss_of(b, logits) : models::token_cross_entropy(logits, dp_slice(b.targets)))
            .item<double>();
  }
  module().train();
  if (pp_) return pp_->from_last_stage(total / static_cast<double>(n_batches));
  return mean_over_dp(mean_over_cp(total / static_cast<double>(n_batches)));
}

std::vector<int64_t> Trainer::generate(const std::vector<int64_t>& prompt, int64_t n_tokens,
                                       double temperature, uint64_t seed, int64_t decodable) {
  const auto invariant = layout_invariant_mode();
  at::NoGradGuard no_grad;
  module().eval();
  std::vector<int64_t> tokens = prompt;
  const int64_t window = config_.seq_len;
  for (int64_t i = 0; i < n_tokens; ++i) {
    // A full window, right-padded: causal attention keeps the padding out of earlier
    // positions, and sequence parallelism needs the fixed length.
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(tokens.size()), window);
    auto input = at::zeros({1, window}, at::kLong);
    std::copy(tokens.end() - n, tokens.end(), input.data_ptr<int64_t>());
    // Under --pp the last stage samples and tells the others.
    auto logits = pp_ ? pp_->forward(input) : model_->forward(input);
    int64_t token = 0;
    if (logits.defined()) {
      if (is_dtensor(logits)) logits = full_tensor(logits);
      at::Tensor last = logits.select(1, n - 1);                    // (1, vocab)
      last = last.narrow(1, 0, std::min(decodable, last.size(1)));  // ids the tokenizer has
      // The library's sampler (generate() draws with it too): one generator per (seed, step).
      token = models::sample_next_tokens(last, {.temperature = temperature, .seed = seed}, i)
                  .item<int64_t>();
    }
    if (pp_) token = static_cast<int64_t>(pp_->from_last_stage(static_cast<double>(token)));
    tokens.push_back(token);
  }
  module().train();
  return {tokens.begin() + static_cast<std::ptrdiff_t>(prompt.size()), tokens.end()};
}

}  // namespace dtensor::train
