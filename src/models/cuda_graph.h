#pragma once
// The CUDA graph behind CapturedStep. Two definitions, one per build: cuda_graph.cpp against a
// CUDA LibTorch (at::cuda::CUDAGraph), cuda_graph_unavailable.cpp against a CPU one (refuses).
#include <functional>
#include <memory>

#include "dtensor/models/captured_step.h"

namespace dtensor::models {

class CapturedStep::Graph {
 public:
  Graph();  // a CPU build throws: no CUDA graphs
  ~Graph();
  /// Runs `fn` on a side stream, ordered after the current stream's work and before its next.
  void warm_up(const std::function<void()>& fn);
  /// Records `fn` into the graph on a side stream and a private memory pool.
  void capture(const std::function<void()>& fn);
  /// Launches the recorded graph on the current stream.
  void replay();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

namespace detail {
bool cuda_graphs_compiled();
}

}  // namespace dtensor::models
