#pragma once
// How tensor parallelism laid a model out, read from its parameters' DTensor specs (the model
// itself keeps no record of it): the TP mesh, this rank's place on it and which KV heads it
// holds. The cached decoder and the KV cache read it.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/transformer.h"

namespace dtensor::models::detail {

struct TpLayout {
  std::optional<DeviceMesh> mesh;  // the TP mesh (1-D); nullopt: plain parameters
  int64_t tp = 1, rank = 0;
  // Whether wk/wv are sharded on their KV-head rows (ColwiseParallel), else whole on every rank
  // (the replicated KV projection, of which a rank keeps the heads kv_heads its query heads use).
  bool kv_sharded = true;
  at::Tensor kv_heads;  // the KV heads (global indices) this rank keeps, in its query heads' order
};

// The layout of `model` (its embedding's, or its first block's query projection's spec); throws
// naming the parameter when it lies on a mesh of more than one dimension (FSDP's leaves).
TpLayout tp_layout_of(const TransformerImpl& model);

}  // namespace dtensor::models::detail
