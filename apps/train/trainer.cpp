#include "trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <unordered_set>

#include "dtensor/ac/checkpoint.h"
#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/dispatch/implicit_replication.h"
#include "dtensor/fsdp/fully_shard.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/models/meta_init.h"
#include "pipeline_part.h"

namespace dtensor::train {

DeviceMesh make_train_mesh(const RunConfig& cfg, const std::string& device_type) {
  if (cfg.pp > 1 && cfg.fsdp) {
    return init_device_mesh(device_type, {cfg.pp, cfg.dp, cfg.tp}, {"pp", "dp", "tp"});
  }
  if (cfg.pp > 1) return init_device_mesh(device_type, {cfg.pp, cfg.tp}, {"pp", "tp"});
  return cfg.dp > 1 ? init_device_mesh(device_type, {cfg.dp, cfg.tp}, {"dp", "tp"})
                    : init_device_mesh(device_type, {cfg.tp}, {"tp"});
}

Trainer::Trainer(const RunConfig& config, std::optional<DeviceMesh> mesh)
    : config_(config), mesh_(std::move(mesh)) {
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
  const bool load_hf = !config_.hf_dir.empty() && !config_.meta;
  if (!pp_ && mesh_ && (!config_.fsdp || config_.tp > 1)) {
    const DeviceMesh tp_mesh = mesh_->ndim() == 1 ? *mesh_ : (*mesh_)["tp"];
    if (config_.plan) {
      apply_plan_file(*model_, tp_mesh, *config_.plan);
    } else {
      models::TensorParallelOptions tp;
      tp.sequence_parallel = config_.sequence_parallel;
      tp.loss_parallel = config_.loss_parallel;
      tp.overlap_comm = config_.overlap_comm;
      models::apply_tensor_parallel(*model_, tp_mesh, tp);
    }
  }
  if (load_hf && !pp_) models::load_hf_weights(config_.hf_dir, *model_);
  torch::nn::Module& trained = module();
  ac::apply_ac<models::TransformerBlockImpl>(trained, ac::parse_ac_mode(config_.ac),
                                             {.replay_collectives = config_.ac_replay_collectives});
  if (mesh_ && config_.fsdp && !pp_) {           // under --pp the PipelinePart shards its stages
    std::unordered_set<std::string> replicated;  // by name: fully_shard makes plain shards
    for (const auto& p : unique_named_parameters(*model_))
      if (!is_dtensor(p.value()) || spec_of(p.value()).is_replicated()) replicated.insert(p.key());
    const DeviceMesh dp_mesh = mesh_->ndim() == 1 ? *mesh_ : (*mesh_)["dp"];
    for (auto& block : *model_->layers)
      fsdp::fully_shard(*block, dp_mesh, fsdp_unit_options(config_, /*root=*/false));
    fsdp::fully_shard(*model_, dp_mesh, fsdp_unit_options(config_, /*root=*/true));
    for (const auto& p : unique_named_parameters(*model_))
      tp_replicated_.push_back(replicated.count(p.key()) > 0);
  }

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

at::Tensor Trainer::dp_slice(const at::Tensor& t) const {
  if (!mesh_ || config_.dp == 1) return t;
  const int64_t rows = t.size(0) / config_.dp;
  return t.narrow(0, mesh_->get_local_rank("dp") * rows, rows).contiguous();
}

double Trainer::mean_over_dp(double v) const {
  if (!mesh_ || config_.dp == 1) return v;
  auto t = at::full({1}, v, at::kDouble);
  return comm::all_reduce(t, ReduceOp::Sum, mesh_->group(mesh_->dim_index("dp"))).item<double>() /
         static_cast<double>(config_.dp);
}

// Data parallelism: each dp rank saw its slice of the batch; average the gradients over the
// dp group with one all_reduce of all local gradient shards flattened together.
void Trainer::all_reduce_dp_grads() {
  if (!mesh_ || config_.dp == 1) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> locals;
  for (const auto& p : params_) {
    const at::Tensor& g = p.grad();
    if (g.defined()) locals.push_back(is_dtensor(g) ? to_local(g) : g);
  }
  if (locals.empty()) return;
  std::vector<at::Tensor> flat;
  for (const auto& l : locals) flat.push_back(l.reshape({-1}));
  auto summed =
      comm::all_reduce(at::cat(flat), ReduceOp::Sum, mesh_->group(mesh_->dim_index("dp")));
  summed.div_(static_cast<double>(config_.dp));
  int64_t offset = 0;
  for (auto& l : locals) {
    l.copy_(summed.narrow(0, offset, l.numel()).view(l.sizes()));
    offset += l.numel();
  }
}

// FSDP: every rank holds a slice of each gradient (of its tp share under TP), so the squares
// are summed over dp, and over tp for what TP shards, and under --pp over the stages (the last
// stage's copy of a tied embedding left out); then the scaling of LibTorch's
// clip_grad_norm_.
double Trainer::clip_sharded_grad_norm(double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  at::Tensor squares = at::zeros({2}, at::kDouble);  // [tp-sharded, tp-replicated]
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    if (pp_ && pp_->is_tied_copy(params_[i])) continue;  // counted on the first stage
    const bool replicated = pp_ ? pp_->tp_replicated(params_[i]) : tp_replicated_[i];
    squares.narrow(0, replicated ? 1 : 0, 1).add_(g.to(at::kDouble).pow(2).sum());
  }
  squares = comm::all_reduce(squares, ReduceOp::Sum, mesh_->group(mesh_->dim_index("dp")));
  at::Tensor sharded = squares.narrow(0, 0, 1).clone();
  if (config_.tp > 1)
    sharded = comm::all_reduce(sharded, ReduceOp::Sum, mesh_->group(mesh_->dim_index("tp")));
  double total = sharded.item<double>() + squares[1].item<double>();
  if (pp_) total = pp_->sum_over_stages(total);  // each stage's shards once
  const double norm = std::sqrt(total);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1)
    for (auto& g : grads) g.mul_(coef);
  return norm;
}

// LibTorch's clip_grad_norm_ runs on DTensor gradients (pending p-norms, one all_reduce for the
// sharded ones); the plain gradients of the norm weights without sequence parallelism join them
// as replicated values.
double Trainer::clip_grad_norm(double max_norm) {
  if (mesh_ && config_.fsdp) return clip_sharded_grad_norm(max_norm);
  if (pp_) return clip_pipeline_grad_norm(max_norm);
  ImplicitReplication plain_gradients_are_replicated;
  return torch::nn::utils::clip_grad_norm_(params_, max_norm);
}

// Each stage's norm as above, then the squares summed over the stages; the last stage's copy of
// a tied embedding has the first stage's gradient and is counted there only.
double Trainer::clip_pipeline_grad_norm(double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> counted, grads;
  for (const auto& p : params_) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    if (!pp_->is_tied_copy(p)) counted.push_back(p);
  }
  double stage_norm = 0;
  {
    ImplicitReplication plain_gradients_are_replicated;
    stage_norm =
        torch::nn::utils::clip_grad_norm_(counted, std::numeric_limits<double>::infinity());
  }
  const double norm = std::sqrt(pp_->sum_over_stages(stage_norm * stage_norm));
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1)
    for (auto& g : grads) g.mul_(coef);
  return norm;
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
  if (pp_) {
    at::Tensor loss =
        pp_->run_schedule({dp_slice(global_batch.inputs), dp_slice(global_batch.targets)});
    if (config_.tp > 1) models::reduce_partial_grads(pp_->stage());
    return loss;
  }
  auto logits = logits_for_loss(config_, model_->forward(dp_slice(global_batch.inputs)));
  auto loss = models::loss_and_backward(logits, dp_slice(global_batch.targets));
  if (mesh_ && !config_.fsdp) {  // FSDP's backward already reduce-scattered the gradients
    models::reduce_partial_grads(*model_);
    all_reduce_dp_grads();
  }
  return loss;
}

StepStats Trainer::train_step(int64_t step, const Batch& global_batch) {
  StepStats stats;
  stats.lr = config_.schedule.at(step);
  for (auto& group : optimizer_->param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(stats.lr);
  }
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
    stats.loss = mean_over_dp(loss.item<double>());
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
  at::NoGradGuard no_grad;
  module().eval();
  double total = 0;
  for (int64_t k = 0; k < n_batches; ++k) {
    const Batch b = val.get(k);
    if (pp_) {  // the loss on the last stage, then on every rank
      const at::Tensor logits = pp_->forward(b.inputs);
      if (logits.defined()) total += models::token_cross_entropy(logits, b.targets).item<double>();
      continue;
    }
    auto logits = logits_for_loss(config_, model_->forward(dp_slice(b.inputs)));
    total += models::token_cross_entropy(logits, dp_slice(b.targets)).item<double>();
  }
  module().train();
  if (pp_) return pp_->from_last_stage(total / static_cast<double>(n_batches));
  return mean_over_dp(total / static_cast<double>(n_batches));
}

std::vector<int64_t> Trainer::generate(const std::vector<int64_t>& prompt, int64_t n_tokens,
                                       double temperature, uint64_t seed, int64_t decodable) {
  at::NoGradGuard no_grad;
  module().eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
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
      auto last = logits.select(1, n - 1).squeeze(0).to(at::kDouble);
      last = last.narrow(0, 0, std::min(decodable, last.size(0)));  // ids the tokenizer has
      auto probs = at::softmax(last / temperature, 0);
      token = at::multinomial(probs, 1, false, gen).item<int64_t>();
    }
    if (pp_) token = static_cast<int64_t>(pp_->from_last_stage(static_cast<double>(token)));
    tokens.push_back(token);
  }
  module().train();
  return {tokens.begin() + static_cast<std::ptrdiff_t>(prompt.size()), tokens.end()};
}

}  // namespace dtensor::train
