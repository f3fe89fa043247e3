// residual_dropout: see include/dtensor/models/residual_dropout.h.
#include "dtensor/models/residual_dropout.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtensor/core/dtensor_impl.h"
#include "dtensor/core/random.h"

namespace dtensor::models {
namespace {

thread_local std::optional<DropoutKey> current_key;

}  // namespace

DropoutKeyScope::DropoutKeyScope(const DropoutKey& key) : previous_(current_key) {
  TORCH_CHECK(key.global_rows > 0 && key.first_row >= 0 && key.first_row < key.global_rows,
              "DropoutKeyScope: first_row ", key.first_row, " is not a row of a batch of ",
              key.global_rows);
  current_key = key;
}

DropoutKeyScope::~DropoutKeyScope() { current_key = previous_; }

void DropoutKeyScope::set_first_row(int64_t first_row) {
  TORCH_CHECK(current_key && first_row >= 0 && first_row < current_key->global_rows,
              "DropoutKeyScope::set_first_row: ", first_row, " is not a row of the key's batch");
  current_key->first_row = first_row;
}

at::Tensor residual_dropout(const at::Tensor& x, double p, int64_t layer, int64_t site) {
  TORCH_CHECK(p >= 0 && p < 1, "residual dropout: p must be in [0, 1), got ", p);
  TORCH_CHECK(!is_dtensor(x) && x.dim() == 3,
              "residual dropout: a block's output must be a plain (batch, sequence, dim) tensor, "
              "got ",
              is_dtensor(x) ? "a DTensor" : "sizes " + c10::str(x.sizes()));
  if (p == 0) return x;
  if (x.is_meta()) return x * at::empty_like(x);  // shapes only (a plan): nothing to draw
  at::Tensor u;
  const auto options = at::TensorOptions().dtype(at::kDouble);
  if (current_key) {
    const DropoutKey& k = *current_key;
    TORCH_CHECK(k.first_row + x.size(0) <= k.global_rows, "residual dropout: the local batch of ",
                x.size(0), " rows from row ", k.first_row, " does not fit the key's ",
                k.global_rows, " rows");
    const std::vector<int64_t> global = {k.global_rows, x.size(1), x.size(2)};
    const auto per_site = static_cast<uint64_t>(k.global_rows * x.size(1) * x.size(2));
    const random::Draw d{k.seed, static_cast<uint64_t>(2 * layer + site) * per_site};
    u = random::uniform_block(d, global, x.sizes(), {k.first_row, 0, 0}, options);
  } else {
    u = random::uniform_block(random::reserve(x.numel()), x.sizes(), x.sizes(), {0, 0, 0}, options);
  }
  const at::Tensor keep = u.lt(1.0 - p).to(x.device(), x.scalar_type()).mul_(1.0 / (1.0 - p));
  return x * keep;
}

}  // namespace dtensor::models
