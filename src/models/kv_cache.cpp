// The KV cache of generate.h: this rank's KV heads, preallocated per layer.
#include <ATen/ATen.h>

#include "dtensor/core/dtensor_impl.h"
#include "dtensor/models/generate.h"
#include "tp_layout.h"

namespace dtensor::models {

int64_t KVCache::local_kv_heads(const TransformerImpl& model) {
  return detail::tp_layout_of(model).kv_heads.numel();
}

KVCache::KVCache(const TransformerImpl& model, int64_t batch, int64_t max_len)
    : batch_(batch), max_len_(max_len) {
  const DecoderConfig& c = model.config();
  TORCH_CHECK(batch > 0, "KVCache: batch must be positive, got ", batch);
  TORCH_CHECK(max_len > 0 && max_len <= c.max_seq_len, "KVCache: max_len must be in [1, ",
              "max_seq_len=", c.max_seq_len, "] (the rotary table's length), got ", max_len);
  const at::Tensor& w = model.norm->weight;
  const auto options = (is_dtensor(w) ? local_tensor(w) : w).options();
  const std::vector<int64_t> shape{batch, max_len, local_kv_heads(model), c.head_dim()};
  for (int64_t l = 0; l < c.n_layers; ++l) {
    keys_.push_back(at::zeros(shape, options));
    values_.push_back(at::zeros(shape, options));
  }
  padding_ = at::zeros({batch}, at::kLong);
}

int64_t KVCache::bytes() const {
  int64_t total = 0;
  for (size_t l = 0; l < keys_.size(); ++l) total += keys_[l].nbytes() + values_[l].nbytes();
  return total;
}

void KVCache::set_padding(at::Tensor padding) {
  TORCH_CHECK(padding.dim() == 1 && padding.size(0) == batch_ && padding.scalar_type() == at::kLong,
              "KVCache::set_padding: expected (", batch_, ",) int64, got ", padding.sizes(), " ",
              padding.scalar_type());
  TORCH_CHECK(length_ == 0, "KVCache::set_padding: the cache already holds ", length_,
              " slots; set the padding before the first forward (or reset())");
  padding_ = std::move(padding);
}

}  // namespace dtensor::models
