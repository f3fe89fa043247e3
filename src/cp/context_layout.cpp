// The token layouts of context parallelism and their load balancers (context_layout.h).
#include "dtensor/cp/context_layout.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "dtensor/core/api.h"

namespace dtensor::cp {

struct ContextLayout::Impl {
  int64_t cp = 1, seq_len = 0, local_len = 0;
  bool has_documents = false;
  at::Tensor index, document, positions;  // (B, cp * local_len) int64, CPU
};

ContextLayout::ContextLayout(int64_t cp, int64_t seq_len, bool has_documents,
                             at::Tensor sequence_index, at::Tensor document, at::Tensor positions) {
  TORCH_CHECK(cp >= 1 && sequence_index.dim() == 2 && sequence_index.size(1) % cp == 0,
              "cp::ContextLayout: expected (B, cp * local_len) slots for cp = ", cp, ", got ",
              sequence_index.sizes());
  auto impl = std::make_shared<Impl>();
  impl->cp = cp;
  impl->seq_len = seq_len;
  impl->local_len = sequence_index.size(1) / cp;
  impl->has_documents = has_documents;
  impl->index = std::move(sequence_index);
  impl->document = std::move(document);
  impl->positions = std::move(positions);
  impl_ = std::move(impl);
}

int64_t ContextLayout::cp_size() const { return impl_->cp; }
int64_t ContextLayout::batch() const { return impl_->index.size(0); }
int64_t ContextLayout::seq_len() const { return impl_->seq_len; }
int64_t ContextLayout::local_len() const { return impl_->local_len; }
bool ContextLayout::has_documents() const { return impl_->has_documents; }
const at::Tensor& ContextLayout::sequence_index() const { return impl_->index; }
const at::Tensor& ContextLayout::document() const { return impl_->document; }
const at::Tensor& ContextLayout::positions() const { return impl_->positions; }

at::Tensor ContextLayout::shard(const at::Tensor& x, int64_t rank, int64_t seq_dim, double pad,
                                const char* what) const {
  TORCH_CHECK(x.defined() && x.dim() >= 2, "cp::ContextLayout::shard: ", what,
              " must have a batch dim and a sequence dim");
  const int64_t d = c10::maybe_wrap_dim(seq_dim, x.dim());
  TORCH_CHECK(d != 0, "cp::ContextLayout::shard: ", what,
              ": the sequence dim cannot be dim 0, the batch");
  TORCH_CHECK(x.size(0) == batch() && x.size(d) == seq_len(), "cp::ContextLayout::shard: ", what,
              " has batch ", x.size(0), " and ", x.size(d), " tokens in dim ", d,
              ", but the layout was built for a batch of ", batch(), " rows of ", seq_len(),
              " tokens (document ids inconsistent with the batch?)");
  TORCH_CHECK(rank >= 0 && rank < cp_size(), "cp::ContextLayout::shard: rank ", rank,
              " is outside cp = ", cp_size());
  const int64_t n = local_len();
  const at::Tensor index = impl_->index.narrow(1, rank * n, n).to(x.device());
  const at::Tensor rows = x.movedim(d, 1);  // (B, S, ...)
  const at::Tensor flat = rows.reshape({batch() * seq_len(), -1});
  const at::Tensor base = at::arange(batch(), index.options()).view({-1, 1}) * seq_len();
  const at::Tensor padded = index.lt(0);
  const at::Tensor picked =
      flat.index_select(0, (base + index.clamp_min(0)).view(-1)).view({batch(), n, -1});
  at::Tensor out = picked.masked_fill(padded.unsqueeze(-1), pad);
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[1] = n;
  return out.view(shape).movedim(1, d);
}

at::Tensor ContextLayout::unshard(const at::Tensor& gathered, int64_t seq_dim) const {
  const int64_t d = c10::maybe_wrap_dim(seq_dim, gathered.dim());
  const int64_t slots = cp_size() * local_len();
  TORCH_CHECK(d != 0 && gathered.size(0) == batch() && gathered.size(d) == slots,
              "cp::ContextLayout::unshard: expected a batch of ", batch(), " rows of ", slots,
              " slots in dim ", d, ", got ", gathered.sizes());
  const at::Tensor rows = gathered.movedim(d, 1);
  const at::Tensor flat = rows.reshape({batch() * slots, -1});
  // Where each token of the row lies among the slots (-1: not placed).
  const at::Tensor index = impl_->index;
  at::Tensor where = at::full({batch(), seq_len() + 1}, -1, index.options());
  const at::Tensor slot_ids = at::arange(slots, index.options()).expand({batch(), slots});
  // Padding slots write to the extra column seq_len, dropped below.
  where.scatter_(1, at::where(index.lt(0), seq_len(), index), slot_ids);
  where = where.narrow(1, 0, seq_len()).to(gathered.device());
  const at::Tensor base = at::arange(batch(), where.options()).view({-1, 1}) * slots;
  at::Tensor out = flat.index_select(0, (base + where.clamp_min(0)).view(-1))
                       .view({batch(), seq_len(), -1})
                       .masked_fill(where.lt(0).unsqueeze(-1), 0);
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[1] = seq_len();
  return out.view(shape).movedim(1, d);
}

std::vector<int64_t> ContextLayout::attended_pairs(int64_t window) const {
  TORCH_CHECK(window >= 0, "cp::ContextLayout::attended_pairs: window must be >= 0, got ", window);
  const int64_t n = local_len();
  const auto index = impl_->index.accessor<int64_t, 2>();
  const auto pos = impl_->positions.accessor<int64_t, 2>();
  std::vector<int64_t> pairs(cp_size(), 0);
  for (int64_t b = 0; b < batch(); ++b) {
    for (int64_t s = 0; s < cp_size() * n; ++s) {
      if (index[b][s] < 0) continue;
      // Positions count from each document's start: position p sees p + 1 keys.
      const int64_t keys = pos[b][s] + 1;
      pairs[s / n] += window > 0 ? std::min(keys, window) : keys;
    }
  }
  return pairs;
}

double ContextLayout::imbalance(int64_t window) const {
  const auto pairs = attended_pairs(window);
  const double total = static_cast<double>(std::accumulate(pairs.begin(), pairs.end(), 0LL));
  if (total == 0) return 1.0;
  const double max = static_cast<double>(*std::max_element(pairs.begin(), pairs.end()));
  return max * static_cast<double>(pairs.size()) / total;
}

namespace {

// One document of a row: tokens [start, start + length).
struct Document {
  int64_t start, length;
};

// Each row's documents, read from document ids (B, S): ids >= 0 non-decreasing along a row (a
// document is one contiguous run), then optionally padding (-1) to the row's end. Without ids,
// each row is one document of S tokens.
std::vector<std::vector<Document>> documents_of(const at::Tensor& ids, int64_t batch,
                                                int64_t seq_len, const char* fn) {
  std::vector<std::vector<Document>> rows(batch);
  if (!ids.defined()) {
    for (auto& r : rows) r.push_back({0, seq_len});
    return rows;
  }
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == batch && ids.size(1) == seq_len, "cp::", fn,
              ": document_ids must be (batch, seq_len) = (", batch, ", ", seq_len, "), got ",
              ids.sizes());
  TORCH_CHECK(at::isIntegralType(ids.scalar_type(), /*includeBool=*/false), "cp::", fn,
              ": document_ids must be integers, got ", ids.scalar_type());
  const at::Tensor host = ids.to(at::kCPU, at::kLong).contiguous();
  const auto a = host.accessor<int64_t, 2>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq_len; ++s) {
      const int64_t id = a[b][s];
      TORCH_CHECK(id >= -1, "cp::", fn, ": document_ids row ", b, " has id ", id, " at position ",
                  s, "; ids are >= 0, or -1 for padding");
      if (s == 0) {
        if (id >= 0) rows[b].push_back({0, 1});
        continue;
      }
      const int64_t prev = a[b][s - 1];
      if (id == -1) continue;
      TORCH_CHECK(prev != -1, "cp::", fn, ": document_ids row ", b, " has document ", id,
                  " at position ", s, " after padding (-1); padding may only end a row");
      TORCH_CHECK(id >= prev, "cp::", fn, ": document_ids row ", b, " goes back from document ",
                  prev, " to ", id, " at position ", s,
                  "; ids must not decrease along a row (each document one contiguous run)");
      if (id == prev) {
        ++rows[b].back().length;
      } else {
        rows[b].push_back({s, 1});
      }
    }
  }
  return rows;
}

void check_split(int64_t seq_len, int64_t cp, const char* fn) {
  TORCH_CHECK(cp >= 1, "cp::", fn, ": cp must be >= 1, got ", cp);
  TORCH_CHECK(seq_len >= cp, "cp::", fn, ": a sequence of ", seq_len,
              " tokens cannot be split over cp = ", cp,
              " ranks (each rank needs at least one token); use a shorter cp or longer sequences");
}

// The layout from each rank's tokens of each row (positions in the row, in the order the rank
// holds them), padded per rank to local_len.
ContextLayout assemble(const std::vector<std::vector<std::vector<int64_t>>>& tokens, int64_t cp,
                       int64_t seq_len, int64_t local_len,
                       const std::vector<std::vector<Document>>& docs, bool has_documents) {
  const int64_t batch = static_cast<int64_t>(tokens.size()), slots = cp * local_len;
  at::Tensor index = at::full({batch, slots}, -1, at::kLong);
  at::Tensor document = at::full({batch, slots}, -1, at::kLong);
  at::Tensor positions = at::zeros({batch, slots}, at::kLong);
  auto ia = index.accessor<int64_t, 2>();
  auto da = document.accessor<int64_t, 2>();
  auto pa = positions.accessor<int64_t, 2>();
  for (int64_t b = 0; b < batch; ++b) {
    // Document and its start for each token of the row.
    std::vector<int64_t> doc_of(seq_len, -1), start_of(seq_len, 0);
    for (size_t d = 0; d < docs[b].size(); ++d) {
      for (int64_t t = 0; t < docs[b][d].length; ++t) {
        doc_of[docs[b][d].start + t] = static_cast<int64_t>(d);
        start_of[docs[b][d].start + t] = docs[b][d].start;
      }
    }
    for (int64_t r = 0; r < cp; ++r) {
      const auto& mine = tokens[b][r];
      TORCH_INTERNAL_ASSERT(static_cast<int64_t>(mine.size()) <= local_len);
      for (size_t i = 0; i < mine.size(); ++i) {
        const int64_t slot = r * local_len + static_cast<int64_t>(i), t = mine[i];
        if (t < 0 || doc_of[t] < 0) continue;
        ia[b][slot] = t;
        da[b][slot] = doc_of[t];
        pa[b][slot] = t - start_of[t];
      }
    }
  }
  return ContextLayout(cp, seq_len, has_documents, index, document, positions);
}

}  // namespace

at::Tensor document_ids_from_lengths(const std::vector<std::vector<int64_t>>& lengths,
                                     int64_t seq_len) {
  at::Tensor ids = at::full({static_cast<int64_t>(lengths.size()), seq_len}, -1, at::kLong);
  for (size_t b = 0; b < lengths.size(); ++b) {
    int64_t at_token = 0;
    for (size_t d = 0; d < lengths[b].size(); ++d) {
      const int64_t len = lengths[b][d];
      TORCH_CHECK(len > 0, "cp::document_ids_from_lengths: row ", b, " document ", d,
                  " has length ", len, "; lengths must be positive");
      TORCH_CHECK(at_token + len <= seq_len, "cp::document_ids_from_lengths: row ", b,
                  "'s documents add up to more than seq_len = ", seq_len, " tokens");
      ids[b].narrow(0, at_token, len).fill_(static_cast<int64_t>(d));
      at_token += len;
    }
  }
  return ids;
}

ContextLayout head_tail_layout(int64_t batch, int64_t seq_len, int64_t cp,
                               const at::Tensor& document_ids) {
  check_split(seq_len, cp, "head_tail_layout");
  const auto docs = documents_of(document_ids, batch, seq_len, "head_tail_layout");
  const int64_t chunk = (seq_len + 2 * cp - 1) / (2 * cp);
  std::vector<std::vector<int64_t>> per_rank(cp);
  for (int64_t r = 0; r < cp; ++r) {
    for (int64_t c : {r, 2 * cp - 1 - r}) {
      // Tokens past the row's end are the padding of the last chunks.
      for (int64_t t = c * chunk; t < (c + 1) * chunk; ++t)
        per_rank[r].push_back(t < seq_len ? t : -1);
    }
  }
  const std::vector<std::vector<std::vector<int64_t>>> tokens(batch, per_rank);
  return assemble(tokens, cp, seq_len, 2 * chunk, docs, document_ids.defined());
}

ContextLayout balanced_layout(const at::Tensor& document_ids, int64_t cp) {
  TORCH_CHECK(document_ids.defined() && document_ids.dim() == 2,
              "cp::balanced_layout: document_ids must be (batch, seq_len)");
  const int64_t batch = document_ids.size(0), seq_len = document_ids.size(1);
  check_split(seq_len, cp, "balanced_layout");
  const auto docs = documents_of(document_ids, batch, seq_len, "balanced_layout");
  const int64_t local_len = (seq_len + cp - 1) / cp;
  std::vector<std::vector<std::vector<int64_t>>> tokens(batch);
  for (int64_t b = 0; b < batch; ++b) {
    auto& mine = tokens[b];
    mine.assign(cp, {});
    std::vector<int64_t> work(cp, 0);
    // (keys it sees, position in the row) of each token left after the chunks.
    std::vector<std::pair<int64_t, int64_t>> rest;
    for (const Document& d : docs[b]) {
      const int64_t chunk = d.length / (2 * cp);
      for (int64_t r = 0; r < cp; ++r) {
        for (int64_t c : {r, 2 * cp - 1 - r}) {
          for (int64_t p = c * chunk; p < (c + 1) * chunk; ++p) {
            mine[r].push_back(d.start + p);
            work[r] += p + 1;
          }
        }
      }
      for (int64_t p = 2 * cp * chunk; p < d.length; ++p) rest.emplace_back(p + 1, d.start + p);
    }
    // Heaviest first, each to the least-loaded rank with room (lowest rank on ties).
    std::stable_sort(rest.begin(), rest.end(),
                     [](const auto& x, const auto& y) { return x.first > y.first; });
    for (const auto& [keys, t] : rest) {
      int64_t best = -1;
      for (int64_t r = 0; r < cp; ++r) {
        if (static_cast<int64_t>(mine[r].size()) >= local_len) continue;
        if (best < 0 || work[r] < work[best]) best = r;
      }
      TORCH_INTERNAL_ASSERT(best >= 0, "cp::balanced_layout: no rank has room");
      mine[best].push_back(t);
      work[best] += keys;
    }
    // In row order on each rank, so that a document's tokens form few contiguous runs.
    for (auto& m : mine) std::sort(m.begin(), m.end());
  }
  return assemble(tokens, cp, seq_len, local_len, docs, /*has_documents=*/true);
}

at::Tensor distribute_sequence(const at::Tensor& x, const ContextLayout& layout,
                               const DeviceMesh& mesh, const std::string& cp_dim, int64_t seq_dim,
                               double pad) {
  const int64_t dim = mesh.dim_index(cp_dim);
  TORCH_CHECK(mesh.size(dim) == layout.cp_size(), "cp::distribute_sequence: mesh dim '", cp_dim,
              "' has ", mesh.size(dim),
              " ranks but the layout splits over cp = ", layout.cp_size());
  const int64_t d = c10::maybe_wrap_dim(seq_dim, x.dim());
  std::vector<Placement> placements(mesh.ndim(), Replicate());
  placements[dim] = Shard(d);
  return from_local(layout.shard(x, mesh.get_local_rank(dim), d, pad), mesh, placements);
}

}  // namespace dtensor::cp
