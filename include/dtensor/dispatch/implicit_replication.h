#pragma once

namespace dtensor {

/// While alive, plain non-scalar tensors mixed with DTensors are treated as Replicate
/// (PyTorch's implicit_replication()). Thread-local; not re-entrant, like PyTorch's.
class ImplicitReplication {
 public:
  /// Enables implicit replication on this thread.
  ImplicitReplication();
  /// Disables it again.
  ~ImplicitReplication();
  ImplicitReplication(const ImplicitReplication&) = delete;
  ImplicitReplication& operator=(const ImplicitReplication&) = delete;
  /// Whether an ImplicitReplication is alive on this thread.
  static bool enabled();
};

}  // namespace dtensor
