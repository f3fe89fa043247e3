// The tensor-parallel layout of a model, read from its parameters: see tp_layout.h.
#include "tp_layout.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

#include "dtensor/core/dtensor_impl.h"

namespace dtensor::models::detail {

TpLayout tp_layout_of(const TransformerImpl& model) {
  const DecoderConfig& c = model.config();
  TpLayout out;
  // Every TP parameter lies on the one TP mesh: the first DTensor parameter tells it.
  std::string name;
  for (const auto& p : model.named_parameters()) {
    if (!is_dtensor(p.value())) continue;
    name = p.key();
    out.mesh = spec_of(p.value()).mesh();
    break;
  }
  if (out.mesh) {
    TORCH_CHECK(out.mesh->ndim() == 1, "parameter '", name, "' lies on the ", out.mesh->ndim(),
                "-D mesh ", out.mesh->str(),
                "; cached inference takes a model parallelized by tensor parallelism alone (a 1-D "
                "mesh), not FSDP's leaves");
    out.tp = out.mesh->size();
    out.rank = out.mesh->get_local_rank();
  }
  const std::vector<TransformerBlockImpl*> blocks = model.blocks();
  if (out.tp > 1 && !blocks.empty()) {
    const at::Tensor& wk = blocks.front()->attention->wk->weight;
    out.kv_sharded = is_dtensor(wk) && placements(wk).at(0).is_shard(0);
  }
  if (out.kv_sharded) {
    const int64_t local = c.kv_heads() / out.tp;
    out.kv_heads = at::arange(out.rank * local, (out.rank + 1) * local, at::kLong);
  } else {
    out.kv_heads = kv_heads_of_rank(c.n_heads, c.kv_heads(), out.rank, out.tp);
  }
  return out;
}

}  // namespace dtensor::models::detail
