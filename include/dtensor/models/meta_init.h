#pragma once
// Models no rank holds whole: built on the meta device (shapes and dtypes, no memory), cut by the
// tensor-parallel plan, and only then given memory, each rank for its own parameters. So a model
// larger than one rank's memory loads over enough ranks:
//
//   auto mesh = init_device_mesh("cpu", {comm::get_world_size()});
//   auto model = empty_transformer(config, at::kBFloat16, mesh);  // local shards, uninitialised
//   checkpoint::load_checkpoint(path, *model);                    // or model->init_weights(seed)
//
// load_hf (hf_checkpoint.h) builds its models this way.
#include <c10/core/ScalarType.h>

#include <optional>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/transformer.h"

namespace dtensor::models {

/// The model with every parameter a meta tensor: shapes and dtypes, no memory and no values
/// (PyTorch's `with torch.device("meta")`). Parallelize it, then give it memory
/// (empty_transformer does both).
Transformer meta_transformer(const DecoderConfig& config);

/// A model in `dtype` of which this rank allocates only its own parameters: meta_transformer,
/// parallelized over `mesh` when given (apply_tensor_parallel; no communication, whatever
/// tp.src_data_rank says), then each parameter (a DTensor's local shard) allocated at its local
/// size, uninitialised. Fill it with init_weights, checkpoint::load_checkpoint or
/// load_hf_weights.
Transformer empty_transformer(const DecoderConfig& config, c10::ScalarType dtype,
                              const std::optional<DeviceMesh>& mesh = std::nullopt,
                              const TensorParallelOptions& tp = {});

}  // namespace dtensor::models
