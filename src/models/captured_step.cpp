#include "dtensor/models/captured_step.h"

#include <c10/util/Exception.h>

#include "cuda_graph.h"

namespace dtensor::models {

bool built_with_cuda_graphs() { return detail::cuda_graphs_compiled(); }

std::optional<std::string> capture_refusal(const CaptureConditions& c) {
  if (c.pipeline) {
    return "pipeline stages exchange activations point to point, whose schedule a graph "
           "cannot hold (capture each stage's forward and backward instead: not yet)";
  }
  if (c.dropless_experts) {
    return "dropless expert dispatch sizes its exchange by the routing, read on the host "
           "(a capacity factor with padding would fix the sizes: not yet)";
  }
  if (c.dynamic_seq_len) {
    return "batches change shape from step to step; a graph replays one shape (pad to a "
           "fixed sequence length)";
  }
  if (!c.cuda) return "the step runs on the CPU; CUDA graphs capture CUDA work only";
  if (!built_with_cuda_graphs()) {
    return "this build of dtensor-cpp is against a CPU LibTorch, which has no CUDA graphs";
  }
  return std::nullopt;
}

CapturedStep::CapturedStep(std::function<at::Tensor()> step, std::vector<at::Tensor> static_inputs,
                           CapturedStepOptions options)
    : step_(std::move(step)), inputs_(std::move(static_inputs)), options_(options) {
  TORCH_CHECK(options_.warmup_steps >= 1,
              "CapturedStep: warmup_steps must be at least 1 (the optimizer's state and the "
              "communicators are made in an eager step), got ",
              options_.warmup_steps);
  TORCH_CHECK(!inputs_.empty(), "CapturedStep: no static inputs (the step's batch lives there)");
  CaptureConditions conditions;
  conditions.cuda = inputs_.front().is_cuda();
  if (auto why = capture_refusal(conditions)) TORCH_CHECK(false, "CapturedStep: ", *why);
  graph_ = std::make_unique<Graph>();
}

CapturedStep::~CapturedStep() = default;

bool CapturedStep::captured() const { return calls_ > options_.warmup_steps; }

at::Tensor CapturedStep::run(const std::vector<at::Tensor>& batch) {
  TORCH_CHECK(batch.size() == inputs_.size(), "CapturedStep::run: expected ", inputs_.size(),
              " batch tensors (one per static input), got ", batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    TORCH_CHECK(batch[i].sizes() == inputs_[i].sizes() && batch[i].dtype() == inputs_[i].dtype(),
                "CapturedStep::run: batch tensor ", i, " is ", batch[i].sizes(), " ",
                batch[i].dtype(), "; the captured step reads ", inputs_[i].sizes(), " ",
                inputs_[i].dtype(), " (a graph replays one shape)");
    inputs_[i].copy_(batch[i], /*non_blocking=*/true);
  }
  ++calls_;
  if (calls_ <= options_.warmup_steps) {
    graph_->warm_up([&] { output_ = step_(); });
    return output_;
  }
  if (calls_ == options_.warmup_steps + 1) graph_->capture([&] { output_ = step_(); });
  graph_->replay();
  return output_;
}

}  // namespace dtensor::models
