#pragma once
// A whole training step replayed as one CUDA graph (issue 41): forward, backward, gradient
// clipping, the optimizer and the collectives, captured once and replayed each step, so the
// host issues one graph launch instead of thousands of ops.
//
//   models::CapturedStep captured([&] { return one_step(static_tokens); }, {static_tokens});
//   for (auto& batch : batches) loss = captured.run({batch});   // copies batch into the inputs
//
// The step reads its batch only from the static inputs (tensors on the GPU that keep their
// memory) and must be capturable: no host read (comm::CaptureRehearsal finds them on CPU),
// device-side clipping (nn::utils::clip_grad_norm_on_device_) and optim::CapturableAdamW, whose
// step count lives on the device. The first `warmup_steps` calls run eagerly on a side stream
// (the optimizer's state, NCCL's communicators and cuBLAS's workspaces are made there), the next
// captures the step into a graph on a private memory pool and replays it, later calls replay.
// Host numbers the step reads (a learning rate) keep the value they had when captured.
// A step that cannot be captured is refused by capture_refusal with the reason; a build
// against a CPU LibTorch refuses every capture.
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtensor::models {

/// What about a training step decides whether it can be captured.
struct CaptureConditions {
  bool pipeline = false;          ///< pipeline stages exchange activations point to point
  bool dropless_experts = false;  ///< MoE dispatch sized by the routing (host-read counts)
  bool dynamic_seq_len = false;   ///< batches of varying shape
  bool cuda = false;              ///< the step runs on CUDA tensors
};

/// Why a step under `c` cannot be captured in one CUDA graph (a one-line reason), or nullopt.
/// Checks this build too: a CPU LibTorch has no CUDA graphs.
std::optional<std::string> capture_refusal(const CaptureConditions& c);

/// Whether this build of dtensor-cpp was compiled against a LibTorch with CUDA graphs.
bool built_with_cuda_graphs();

struct CapturedStepOptions {
  int64_t warmup_steps = 3;  ///< eager steps before the capture (PyTorch's examples use 3)
};

class CapturedStep {
 public:
  /// `step` runs one whole step reading `static_inputs` and returns its output (the loss, a
  /// device tensor). Throws naming the reason where capture_refusal refuses a CUDA step.
  CapturedStep(std::function<at::Tensor()> step, std::vector<at::Tensor> static_inputs,
               CapturedStepOptions options = {});
  ~CapturedStep();
  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;

  /// Copies `batch` (same shapes and dtypes as the static inputs) into the static inputs and
  /// runs the step: eagerly while warming up, then captured and replayed. Returns the step's
  /// output: after the capture, the graph's static output (overwritten by the next replay).
  at::Tensor run(const std::vector<at::Tensor>& batch);

  /// Whether the step has been captured (later calls replay it).
  bool captured() const;

  class Graph;  // the CUDA graph behind it (src/models/cuda_graph*.cpp)

 private:
  std::function<at::Tensor()> step_;
  std::vector<at::Tensor> inputs_;
  CapturedStepOptions options_;
  int64_t calls_ = 0;
  at::Tensor output_;
  std::unique_ptr<Graph> graph_;
};

}  // namespace dtensor::models
