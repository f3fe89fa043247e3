#pragma once

namespace dtensor {

/// While alive, plain non-scalar tensors mixed with DTensors are treated as Replicate
/// (PyTorch's implicit_replication()). Thread-local; not re-entrant, like PyTorch's.
class ImplicitReplication {
 public:
  ImplicitReplication();
  ~ImplicitReplication();
  ImplicitReplication(const ImplicitReplication&) = delete;
  ImplicitReplication& operator=(const ImplicitReplication&) = delete;
  static bool enabled();
};

}  // namespace dtensor
