// CapturedStep's graph in a build against a CPU LibTorch: there is no CUDA graph to capture into.
#include <c10/util/Exception.h>

#include "cuda_graph.h"

namespace dtensor::models {

struct CapturedStep::Graph::State {};

CapturedStep::Graph::Graph() {
  TORCH_CHECK(false,
              "CapturedStep: this build of dtensor-cpp is against a CPU LibTorch, which has no "
              "CUDA graphs; build against a CUDA LibTorch to capture a step");
}
CapturedStep::Graph::~Graph() = default;
void CapturedStep::Graph::warm_up(const std::function<void()>& fn) { fn(); }
void CapturedStep::Graph::capture(const std::function<void()>&) {}
void CapturedStep::Graph::replay() {}

bool detail::cuda_graphs_compiled() { return false; }

}  // namespace dtensor::models
