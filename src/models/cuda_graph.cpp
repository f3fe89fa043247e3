// CapturedStep's graph against a CUDA LibTorch: at::cuda::CUDAGraph on a private pool, warm-up
// and capture on a side stream (capture cannot run on the legacy default stream), replay on the
// caller's stream.
#include "cuda_graph.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace dtensor::models {

struct CapturedStep::Graph::State {
  at::cuda::CUDAGraph graph;
  at::cuda::MempoolId_t pool = at::cuda::graph_pool_handle();
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
};

namespace {

// Runs `fn` on `side`, which first waits for the current stream's work; the current stream then
// waits for `side`'s.
void on_side_stream(c10::cuda::CUDAStream side, const std::function<void()>& fn) {
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
  c10::Event before(c10::DeviceType::CUDA);
  before.record(current);
  before.block(side);
  {
    c10::cuda::CUDAStreamGuard guard(side);
    fn();
  }
  c10::Event after(c10::DeviceType::CUDA);
  after.record(side);
  after.block(current);
}

}  // namespace

CapturedStep::Graph::Graph() : state_(std::make_unique<State>()) {}
CapturedStep::Graph::~Graph() = default;

void CapturedStep::Graph::warm_up(const std::function<void()>& fn) {
  on_side_stream(state_->side, fn);
}

void CapturedStep::Graph::capture(const std::function<void()>& fn) {
  on_side_stream(state_->side, [&] {
    state_->graph.capture_begin(state_->pool);
    try {
      fn();
    } catch (...) {
      try {
        state_->graph.capture_end();  // leave the stream out of capture mode
      } catch (...) {
      }
      throw;
    }
    state_->graph.capture_end();
  });
}

void CapturedStep::Graph::replay() { state_->graph.replay(); }

bool detail::cuda_graphs_compiled() { return true; }

}  // namespace dtensor::models
