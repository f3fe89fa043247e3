#pragma once
// Communication overlapped with compute for a sequence-parallel Colwise -> Rowwise pair
// (docs/ARCHITECTURE.md, "Overlapping communication in sequence-parallel linears").
//
// Each function computes exactly what the Colwise/Rowwise hooks and sharding propagation
// compute for the same layers (same local matmuls on the same operands, same reductions), so the
// results are bitwise equal; only the order in which collectives and matmuls are issued changes:
//   all_gather_matmul      forward: the sequence is gathered in `chunks` pieces, piece k+1 in
//                          flight while piece k is multiplied; backward: the input gradient's
//                          reduce-scatter runs while the weight gradients are computed.
//   matmul_reduce_scatter  forward: piece k of the output is reduce-scattered while piece k+1 is
//                          multiplied; backward: one all-gather of the output gradient.
// Collectives go through dtensor::comm (counted by CommDebugMode, errors naming rank and
// collective). Per call: all_gather_matmul issues `chunks` all-gathers forward and one
// reduce-scatter backward; matmul_reduce_scatter `chunks` reduce-scatters forward and one
// all-gather backward (the non-overlapped pair issues one of each per direction).
#include <ATen/core/Tensor.h>

#include <vector>

#include "dtensor/mesh/device_mesh.h"

namespace dtensor::tp {

/// How many pieces the sequence is cut into: the largest divisor of `local_seq` (this rank's
/// sequence shard length) that is at most `chunks` (at least 1). The same on every rank.
int64_t overlap_chunks(int64_t local_seq, int64_t chunks);

/// x: this rank's sequence shard (B, S/n, D), plain or a Shard(1) DTensor on the 1-D `mesh`;
/// weights: ColwiseParallel Linear weights (Shard(0) DTensors, (out, D), no bias). Returns each
/// layer's local output (B, S, out/n) as a plain tensor, as ColwiseParallel with the default
/// use_local_output returns it after the input was gathered to Replicate. In backward the input
/// gradients of all weights are summed in the order autograd sums them for layers called in
/// `weights` order on one input (`grad_sum_order`, indices into weights; empty: 0, 1, 2, ...).
std::vector<at::Tensor> all_gather_matmul(const at::Tensor& x,
                                          const std::vector<at::Tensor>& weights,
                                          const DeviceMesh& mesh, int64_t chunks,
                                          const std::vector<int64_t>& grad_sum_order = {});

/// x: the local input features (B, S, in/n) as a plain tensor; weight: a RowwiseParallel Linear
/// weight (Shard(1) DTensor, (out, in), no bias). Returns this rank's sequence shard
/// (B, S/n, out) of the summed output as a plain tensor, as RowwiseParallel with
/// output_layouts=Shard(1) returns it.
at::Tensor matmul_reduce_scatter(const at::Tensor& x, const at::Tensor& weight,
                                 const DeviceMesh& mesh, int64_t chunks);

}  // namespace dtensor::tp
