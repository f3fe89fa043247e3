#pragma once
// Rules of tensor parallelism that are checked both ahead of a run (ParallelDims::validate) and
// where a plan meets its input (the hooks apply_tensor_parallel installs), written once so that
// both refuse in the same words.
#include <cstdint>

#include "dtensor/models/transformer.h"

namespace dtensor::models::detail {

// Sequence parallelism keeps equal sequence shards: `seqlen` must divide over `tp` ranks.
void check_sequence_parallel_length(int64_t seqlen, int64_t tp);

// Residual dropout draws its masks for whole sequences: refused in training under sequence
// parallelism (`dropout` > 0).
void check_dropout_without_sequence_parallel(double dropout);

// What overlap_comm needs of the model and the plan on `tp` ranks.
void check_overlap_comm(const DecoderConfig& config, int64_t tp,
                        const TensorParallelOptions& options);

}  // namespace dtensor::models::detail
