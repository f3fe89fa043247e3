#include "pipeline_part.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "dtensor/comm/collectives.h"
#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/dtensor_impl.h"

namespace dtensor::train {
namespace {

// The forward-only passes (evaluation, generation) run after a step's messages are all
// received; their own tag keeps them apart from the schedule's anyway.
constexpr int kForwardOnlyTag = 32000;

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
    : config_(config), stage_(models::split_llama_stage(whole, mesh)) {
  if (config.tp > 1) {
    models::TensorParallelOptions tp;
    tp.sequence_parallel = false;  // activations cross the stage boundaries replicated
    tp.loss_parallel = config.loss_parallel;
    models::apply_tensor_parallel(*stage_, mesh, tp);
  }
  pipe_ = models::make_llama_pipeline_stage(stage_, mesh);
  if (config.meta) {
    // Meta activations carry no values, so the shape message cannot be read: every stage is
    // told the (micro-batch, sequence, dim) activation its neighbours exchange.
    const at::Tensor like =
        at::empty({config.batch_size / config.microbatches, config.seq_len, config.model.dim},
                  at::TensorOptions().device(mesh.device()).dtype(config.dtype));
    pipe_->set_boundary_activations(pipe_->is_first() ? std::nullopt : std::optional(like),
                                    pipe_->is_last() ? std::nullopt : std::optional(like));
  }
  auto loss = [](const at::Tensor& out, const at::Tensor& target) {
    return models::token_cross_entropy(out, target);
  };
  if (config.pp_schedule == "gpipe") {
    schedule_ = std::make_unique<pp::ScheduleGPipe>(*pipe_, config.microbatches, loss);
  } else {
    TORCH_CHECK(config.pp_schedule == "1f1b", "unknown pipeline schedule '", config.pp_schedule,
                "': expected gpipe or 1f1b");
    schedule_ = std::make_unique<pp::Schedule1F1B>(*pipe_, config.microbatches, loss);
  }
}

bool PipelinePart::is_tied_copy(const at::Tensor& param) const {
  return stage_->tied_across_stages() && param.is_same(stage_->output->weight);
}

at::Tensor PipelinePart::run_schedule(const Batch& batch) {
  return schedule_->step(pipe_->is_first() ? batch.inputs : at::Tensor(),
                         pipe_->is_last() ? batch.targets : at::Tensor());
}

PipelinePart::StepResult PipelinePart::step_values(const at::Tensor& loss) {
  const pp::StepTiming& t = schedule_->last_timing();
  const double idle = t.total_s > 0 ? std::clamp(1 - t.compute_s / t.total_s, 0.0, 1.0) : 0.0;
  // One all_reduce carries both: the loss from the last stage, the idle shares from all.
  at::Tensor v =
      at::tensor(std::vector<double>{pipe_->is_last() ? loss.item<double>() : 0.0, idle});
  v = comm::all_reduce(v, ReduceOp::Sum, pipe_->pp_mesh().group(0));
  return {v[0].item<double>(), v[1].item<double>() / static_cast<double>(config_.pp)};
}

double PipelinePart::sum_over_stages(double v) {
  return comm::all_reduce(at::full({1}, v, at::kDouble), ReduceOp::Sum, pipe_->pp_mesh().group(0))
      .item<double>();
}

double PipelinePart::from_last_stage(double v) {
  return comm::broadcast(at::full({1}, v, at::kDouble), static_cast<int>(config_.pp - 1),
                         pipe_->pp_mesh().group(0))
      .item<double>();
}

at::Tensor PipelinePart::forward(const at::Tensor& tokens) {
  at::NoGradGuard no_grad;
  auto& pg = pipe_->pp_mesh().group(0);
  const int s = static_cast<int>(pipe_->stage_index());
  at::Tensor h = tokens;
  if (!pipe_->is_first()) {
    h = comm::recv(at::empty({tokens.size(0), tokens.size(1), config_.model.dim},
                             at::TensorOptions().dtype(config_.dtype)),
                   s - 1, pg, kForwardOnlyTag);
  }
  at::Tensor out = stage_->forward(h);
  if (pipe_->is_last()) return out;
  comm::send(out.contiguous(), s + 1, pg, kForwardOnlyTag);
  return {};
}

int64_t PipelinePart::owner_of(const std::string& name) const {
  const std::string layers = "layers.";
  if (name.rfind("tok_embeddings.", 0) == 0) return 0;
  if (name.rfind(layers, 0) != 0) return config_.pp - 1;  // norm, output
  const int64_t k = std::stoll(name.substr(layers.size(), name.find('.', layers.size())));
  for (int64_t s = 0; s < config_.pp; ++s) {
    auto [first, end] = pp::stage_layer_range(config_.model.n_layers, s, config_.pp);
    if (k >= first && k < end) return s;
  }
  TORCH_CHECK(false, "dtensor_train --pp: block ", k, " of parameter '", name,
              "' is in no stage of ", config_.pp);
}

// Every stage in turn broadcasts its parameters and AdamW state (whole tensors, gathered over
// tp first) over the pp group as one flat tensor: per parameter its value, exp_avg,
// exp_avg_sq and step (0: no state yet).
void PipelinePart::gather_into(torch::optim::AdamW& own_opt, models::TransformerImpl& full,
                               torch::optim::AdamW& full_opt) {
  at::NoGradGuard no_grad;
  const auto own = stage_->named_parameters();
  const auto whole = unique_named_parameters(full);
  const auto options = at::TensorOptions().dtype(config_.dtype);
  for (int64_t s = 0; s < config_.pp; ++s) {
    std::vector<std::pair<std::string, at::Tensor>> owned;
    int64_t numel = 0;
    for (const auto& item : whole) {
      if (owner_of(item.key()) != s) continue;
      owned.emplace_back(item.key(), item.value());
      numel += 3 * item.value().numel() + 1;
    }
    at::Tensor flat;
    if (s == pipe_->stage_index()) {
      std::vector<at::Tensor> parts;
      for (const auto& [name, fp] : owned) {
        const at::Tensor* p = own.find(name);
        TORCH_CHECK(p, pipe_->label(), ": no parameter '", name, "' for the checkpoint");
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
    flat = comm::broadcast(flat, static_cast<int>(s), pipe_->pp_mesh().group(0));
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
  for (const auto& item : stage_->named_parameters()) {
    const at::Tensor& p = item.value();
    // The last stage's copy of a tied embedding is the embedding.
    const std::string name = is_tied_copy(p) ? "tok_embeddings.weight" : item.key();
    const at::Tensor* fp = whole.find(name);
    TORCH_CHECK(fp, pipe_->label(), ": the whole model has no parameter '", name, "'");
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
