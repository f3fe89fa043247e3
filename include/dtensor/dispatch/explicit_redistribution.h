#pragma once

namespace dtensor {

/// While alive on this thread, an op whose sharding rule would move an input to a layout that
/// takes a collective to reach (an implicit all-gather, all-reduce, reduce-scatter or
/// all-to-all) fails instead, naming the op, the input's placements before and after, and the
/// module being run (PyTorch's `ExplicitRedistributionContext`). Moves out of Replicate need
/// no communication and still run. Layout changes you ask for yourself
/// (`redistribute`, `full_tensor`, `to_local`, parallel styles' input/output conversions)
/// still run. Covers backward passes started on this thread (CPU autograd runs there). Use it
/// to prove that a plan communicates only where it says it does.
class ExplicitRedistribution {
 public:
  /// Enables the check on this thread; guards nest.
  ExplicitRedistribution();
  /// Restores the state before construction.
  ~ExplicitRedistribution();
  ExplicitRedistribution(const ExplicitRedistribution&) = delete;
  ExplicitRedistribution& operator=(const ExplicitRedistribution&) = delete;
  /// Whether a guard is alive on this thread.
  static bool enabled();

 private:
  bool prev_;
};

}  // namespace dtensor
