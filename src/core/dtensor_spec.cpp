#include "dtensor/core/dtensor_spec.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>

namespace dtensor {

Placements normalize_placements(c10::ArrayRef<Placement> placements, int64_t tensor_ndim,
                                const DeviceMesh& mesh, const char* api) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(placements.size()) == mesh.ndim(), api,
                    ": `placements` must have the same length as `device_mesh.ndim`! Found "
                    "placements length: ",
                    placements.size(), ", and device_mesh.ndim: ", mesh.ndim(), ".");
  Placements out;
  for (const auto& p : placements) {
    Placement q = p.normalized(tensor_ndim);
    if (q.is_shard()) {
      TORCH_CHECK_INDEX(q.dim() >= 0 && q.dim() < tensor_ndim, api, ": ", p.repr(),
                        " is out of range for a tensor with ", tensor_ndim, " dimensions");
    }
    out.push_back(q);
  }
  return out;
}

DTensorSpec::DTensorSpec(DeviceMesh mesh, c10::ArrayRef<Placement> placements, TensorMeta meta)
    : mesh_(std::move(mesh)), meta_(std::move(meta)) {
  placements_ = normalize_placements(placements, ndim(), mesh_, "DTensorSpec");
  size_t h = mesh_.hash() * 131 + static_cast<size_t>(meta_.dtype);
  for (const auto& p : placements_) h = h * 1000003u ^ p.hash();
  for (auto s : meta_.shape) h = h * 31u ^ static_cast<size_t>(s);
  for (auto s : meta_.stride) h = h * 17u ^ static_cast<size_t>(s);
  hash_ = h;
}

bool DTensorSpec::is_replicated() const {
  return std::ranges::all_of(placements_, &Placement::is_replicate);
}

bool DTensorSpec::has_partial() const {
  return std::ranges::any_of(placements_, &Placement::is_partial);
}

bool DTensorSpec::has_shard() const {
  return std::ranges::any_of(placements_, [](const Placement& p) { return p.is_shard(); });
}

int64_t DTensorSpec::num_shards() const {
  int64_t n = 1;
  for (size_t i = 0; i < placements_.size(); ++i) {
    if (placements_[i].is_shard()) n *= mesh_.size(static_cast<int64_t>(i));
  }
  return n;
}

std::vector<int64_t> DTensorSpec::dim_map() const {
  std::vector<int64_t> m(ndim(), -1);
  for (size_t i = 0; i < placements_.size(); ++i) {
    if (!placements_[i].is_shard()) continue;
    auto& slot = m[placements_[i].dim()];
    TORCH_CHECK(slot == -1, "dtensor: tensor dim ", placements_[i].dim(),
                " is sharded on two mesh dims; this rule does not support that layout");
    slot = static_cast<int64_t>(i);
  }
  return m;
}

LocalShard DTensorSpec::local_shard() const {
  const auto& c = mesh_.coordinate();
  if (!c) return LocalShard{{0}, {}};
  return compute_local_shape_and_global_offset(meta_.shape, mesh_.shape(), *c, placements_);
}

SpecPtr DTensorSpec::with_placements(c10::ArrayRef<Placement> p) const {
  return make_spec(mesh_, p, meta_);
}

bool DTensorSpec::operator==(const DTensorSpec& o) const {
  if (this == &o) return true;
  return hash_ == o.hash_ && placements_.size() == o.placements_.size() &&
         std::equal(placements_.begin(), placements_.end(), o.placements_.begin()) &&
         meta_ == o.meta_ && mesh_ == o.mesh_;
}

std::string DTensorSpec::str() const {
  return c10::str("Spec(", to_string(placements_), "; shape=", c10::IntArrayRef(meta_.shape),
                  "; dtype=", c10::toString(meta_.dtype), ")");
}

}  // namespace dtensor
