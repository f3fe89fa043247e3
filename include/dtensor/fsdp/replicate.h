#pragma once
// replicate: plain data parallelism of a module over a 1-D "dp" mesh (PyTorch's composable
// replicate, DDP's algorithm): every rank keeps the whole module (or its tensor-parallel shards)
// and trains on its rows of the batch; when a backward through the module ends, the gradients
// are averaged over the dp ranks by all-reduces of flat buckets, so every replica takes the same
// optimizer step. models::parallelize applies it where the mesh's "dp" dimension replicates.
//
//   fsdp::replicate(*model, mesh["dp"]);
//   loss.backward();          // at its end: the pending TP sums settled, then the buckets
//   optimizer.step();
//
// Collectives per backward (with gradient sync on): what tp::reduce_partial_grads issues for
// pending (Partial) gradients, then one all_reduce per bucket on the dp group. A bucket holds the
// gradients, in parameter order, of one dtype until adding the next would pass bucket_bytes (a
// gradient larger than that gets a bucket of its own; bucket_bytes 0: one bucket per dtype). Each
// bucket is summed, then divided by dp. set_requires_gradient_sync(module, false)
// (dtensor/fsdp/fully_shard.h) defers the averaging: the backwards accumulate into .grad locally
// until one with sync on averages the sum (a pipeline schedule turns it on for each stage's last
// micro-batch).
//
// The gradients are averaged at the end of the backward pass (an autograd final callback, queued
// when the first gradient reaches the module's output), not overlapped with it.
#include <torch/nn/module.h>

#include <cstdint>

#include "dtensor/mesh/device_mesh.h"

namespace dtensor::fsdp {

/// Options of replicate.
struct ReplicateOptions {
  /// The most bytes one all_reduce carries (DDP's bucket_cap_mb); 0: one bucket per dtype.
  int64_t bucket_bytes = 0;
};

/// Averages `module`'s gradients over the 1-D `dp_mesh` after each backward through it (see the
/// top of this file). `module` must be hook-capable (a dtensor::nn::Module or dtensor::nn layer)
/// and owned by a shared_ptr (a module holder's); its parameters stay as they are.
void replicate(torch::nn::Module& module, const DeviceMesh& dp_mesh, ReplicateOptions options = {});

/// The number of buckets replicate's all_reduces carry `module`'s gradients in, with
/// `bucket_bytes` (its exact all_reduce count per synchronised backward, as the gradients are
/// laid out now: every parameter that requires grad counted).
int64_t replicate_buckets(torch::nn::Module& module, int64_t bucket_bytes);

}  // namespace dtensor::fsdp
