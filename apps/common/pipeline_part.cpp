#include "pipeline_part.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>

#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/fsdp/fully_shard.h"
#include "dtensor/models/hf_checkpoint.h"

namespace dtensor::train {
namespace {

// The global value of `t` (a parameter or its AdamW state; FSDP's and TP's are DTensors).
at::Tensor full_of(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t) : t; }

// `full`, the global value of something laid out like `param`, as `param` holds it here.
at::Tensor laid_out_like(const at::Tensor& param, const at::Tensor& full) {
  if (!is_dtensor(param)) return full.clone();
  const auto& spec = spec_of(param);
  return distribute_tensor(full.clone(), spec.mesh(), spec.placements(), /*src_data_rank=*/{});
}

const torch::optim::AdamWParamState* adam_state(torch::optim::AdamW& opt, const at::Tensor& p) {
  auto it = opt.state().find(p.unsafeGetTensorImpl());
  if (it == opt.state().end()) return nullptr;
  return static_cast<const torch::optim::AdamWParamState*>(it->second.get());
}

}  // namespace

PipelinePart::PipelinePart(models::TransformerImpl& whole, const RunConfig& config,
                           const DeviceMesh& mesh)
    : config_(config), chunks_(std::make_shared<torch::nn::Module>()) {
  // A real run gives memory to this rank's stages only (a plan keeps them shapes), drawn from
  // the seed or read from --hf.
  std::function<void(models::TransformerImpl&)> fill;
  if (!config.meta && config.hf_dir.empty()) {
    fill = [seed = config.seed](models::TransformerImpl& w) { w.init_weights(seed); };
  } else if (!config.meta) {
    fill = [dir = config.hf_dir](models::TransformerImpl& w) { models::load_hf_weights(dir, w); };
  }
  // Which stage holds each parameter, from the split itself (before the stages are
  // parallelized: it cuts the meta model once more, for every stage).
  owners_ = models::stage_of_parameters(whole, config.pp * config.virtual_stages);
  const models::ParallelizeOptions par = parallelize_options(config);
  models::PipelineOptions schedule{
      .schedule = config.pp_schedule,
      .virtual_stages = config.virtual_stages,
      .microbatches = config.microbatches,
      .loss = [config](const at::Tensor& out, const at::Tensor& target) {
        return models::token_cross_entropy(logits_for_loss(config, out), target);
      }};
  pipeline_ = models::parallelize_pipeline(whole, mesh, par, schedule, fill);
  for (size_t k = 0; k < pipeline_.stages.size(); ++k)
    chunks_->register_module(std::to_string(k), pipeline_.stages[k].ptr());
  if (config.meta) {
    // Meta activations carry no values, so the shape message cannot be read: every stage is
    // told the (micro-batch, sequence, dim) activation its neighbours exchange, in the blocks'
    // compute dtype.
    const at::Tensor like = at::empty(
        {config.batch_size / config.dp / config.microbatches, config.seq_len, config.model.dim},
        at::TensorOptions()
            .device(mesh.device())
            .dtype(par.fsdp.param_dtype.value_or(config.dtype)));
    for (auto& p : pipeline_.pipes) {
      p->set_boundary_activations(p->is_first() ? std::nullopt : std::optional(like),
                                  p->is_last() ? std::nullopt : std::optional(like));
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> PipelinePart::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& st : pipeline_.stages)
    for (const auto& item : st->named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

at::Tensor PipelinePart::run_schedule(const Batch& batch, const models::DropoutKey& key) {
  // Each action keys dropout by its micro-batch's rows (a backward's recomputation too).
  models::DropoutKeyScope scope(key);
  const int64_t rows = batch.inputs.size(0) / config_.microbatches;
  pipeline_.schedule->set_action_hook(
      [&](const pp::Action& a) { scope.set_first_row(key.first_row + a.microbatch * rows); });
  at::Tensor loss;
  try {
    loss =
        pipeline_.schedule->step(pipe().is_first() ? batch.inputs : at::Tensor(),
                                 pipeline_.pipes.back()->is_last() ? batch.targets : at::Tensor());
  } catch (...) {
    pipeline_.schedule->set_action_hook(nullptr);  // it refers to this call's scope
    throw;
  }
  pipeline_.schedule->set_action_hook(nullptr);
  return loss;
}

std::vector<double> PipelinePart::microbatch_losses() const {
  std::vector<double> out;
  for (const at::Tensor& l : pipeline_.schedule->microbatch_losses())
    out.push_back(l.item<double>());
  return out;
}

PipelinePart::StepResult PipelinePart::step_values(const at::Tensor& loss) {
  const bool last = pipeline_.pipes.back()->is_last();
  const pp::StepTiming& t = pipeline_.schedule->last_timing();
  const double idle = t.total_s > 0 ? std::clamp(1 - t.compute_s / t.total_s, 0.0, 1.0) : 0.0;
  // One all_reduce carries both: the loss from the last stage, the idle shares from all.
  at::Tensor v = at::tensor(std::vector<double>{last ? loss.item<double>() : 0.0, idle});
  v = comm::all_reduce(v, ReduceOp::Sum, pipe().pp_mesh().group(0));
  return {v[0].item<double>(), v[1].item<double>() / static_cast<double>(config_.pp)};
}

double PipelinePart::from_last_stage(double v) {
  return comm::broadcast(at::full({1}, v, at::kDouble), static_cast<int>(config_.pp - 1),
                         pipe().pp_mesh().group(0))
      .item<double>();
}

// The whole batch as one micro-batch through the stages (pp::Schedule::eval), as one device
// computes it.
at::Tensor PipelinePart::forward(const at::Tensor& tokens) {
  return pipeline_.schedule->eval(tokens, /*n_microbatches=*/1);
}

// Every stage in turn broadcasts its parameters and AdamW state (whole tensors, gathered over
// tp first) over the pp group as one flat tensor: per parameter its value, exp_avg,
// exp_avg_sq and step (0: no state yet).
void PipelinePart::gather_into(torch::optim::AdamW& own_opt, models::TransformerImpl& full,
                               torch::optim::AdamW& full_opt) {
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> own;
  for (const auto& [name, p] : named_parameters()) own[name] = p;
  const auto whole = unique_named_parameters(full);
  const auto options = at::TensorOptions().dtype(config_.dtype);
  for (int64_t s = 0; s < config_.pp; ++s) {
    std::vector<std::pair<std::string, at::Tensor>> owned;
    int64_t numel = 0;
    for (const auto& item : whole) {
      if (owners_.at(item.key()) % config_.pp != s) continue;
      owned.emplace_back(item.key(), item.value());
      numel += 3 * item.value().numel() + 1;
    }
    at::Tensor flat;
    if (s == pipe().pp_mesh().get_local_rank()) {
      std::vector<at::Tensor> parts;
      for (const auto& [name, fp] : owned) {
        auto it = own.find(name);
        TORCH_CHECK(it != own.end(), pipe().label(), ": no parameter '", name,
                    "' for the checkpoint");
        const at::Tensor* p = &it->second;
        const auto* st = adam_state(own_opt, *p);
        parts.push_back(full_of(*p).reshape(-1));
        parts.push_back(st ? full_of(st->exp_avg()).reshape(-1) : at::zeros({fp.numel()}, options));
        parts.push_back(st ? full_of(st->exp_avg_sq()).reshape(-1)
                           : at::zeros({fp.numel()}, options));
        parts.push_back(at::full({1}, st ? static_cast<double>(st->step()) : 0.0, options));
      }
      flat = at::cat(parts).to(config_.dtype);
    } else {
      flat = at::empty({numel}, options);
    }
    flat = comm::broadcast(flat, static_cast<int>(s), pipe().pp_mesh().group(0));
    int64_t offset = 0;
    auto next = [&](const at::Tensor& like) {
      at::Tensor v = flat.narrow(0, offset, like.numel()).view(like.sizes());
      offset += like.numel();
      return v;
    };
    for (const auto& [name, fp] : owned) {
      fp.copy_(next(fp));
      at::Tensor exp_avg = next(fp).clone(), exp_avg_sq = next(fp).clone();
      const auto step = static_cast<int64_t>(flat[offset++].item<double>());
      if (step == 0) continue;
      auto st = std::make_unique<torch::optim::AdamWParamState>();
      st->step(step);
      st->exp_avg(exp_avg);
      st->exp_avg_sq(exp_avg_sq);
      full_opt.state()[fp.unsafeGetTensorImpl()] = std::move(st);
    }
  }
}

void PipelinePart::scatter_from(models::TransformerImpl& full, torch::optim::AdamW& full_opt,
                                torch::optim::AdamW& own_opt) {
  at::NoGradGuard no_grad;
  const auto whole = unique_named_parameters(full);
  for (const auto& [key, p] : named_parameters()) {
    // The last stage's copy of a tied embedding is the embedding.
    const std::string name = is_tied_copy(p) ? "tok_embeddings.weight" : key;
    const at::Tensor* fp = whole.find(name);
    TORCH_CHECK(fp, pipe().label(), ": the whole model has no parameter '", name, "'");
    at::Tensor value = laid_out_like(p, *fp);
    (is_dtensor(p) ? local_tensor(p) : p).copy_(is_dtensor(value) ? local_tensor(value) : value);
    const auto* fs = adam_state(full_opt, *fp);
    if (!fs) {
      own_opt.state().erase(p.unsafeGetTensorImpl());
      continue;
    }
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(fs->step());
    st->exp_avg(laid_out_like(p, fs->exp_avg()));
    st->exp_avg_sq(laid_out_like(p, fs->exp_avg_sq()));
    own_opt.state()[p.unsafeGetTensorImpl()] = std::move(st);
  }
}

}  // namespace dtensor::train
