#include "corpus.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "dtensor/util/hash.h"

namespace dtensor::train {
namespace {

// SplitMix64: a good 64-bit mix, so hash(seed, stream, step, row) gives independent-looking
// offsets without any generator state.
uint64_t mix(uint64_t x) { return util::splitmix64(x); }

}  // namespace

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error("cannot open data file '" + path + "': " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw std::runtime_error("error reading data file '" + path + "'");
  return ss.str();
}

TokenSplit split_tokens(std::vector<int64_t> tokens, double val_fraction, int64_t seq_len) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t window = seq_len + 1;
  int64_t n_val = std::max<int64_t>(static_cast<int64_t>(n * val_fraction), window);
  if (n - n_val < window) {
    throw std::runtime_error("the text has " + std::to_string(n) +
                             " tokens: too short for a training and a validation window of " +
                             std::to_string(window) +
                             " tokens each (use a longer file or a smaller --seq-len)");
  }
  TokenSplit split;
  split.val.assign(tokens.end() - n_val, tokens.end());
  tokens.resize(n - n_val);
  split.train = std::move(tokens);
  return split;
}

std::vector<std::string> split_documents(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find("\n\n", at);
    if (end == std::string::npos) end = text.size();
    if (end > at) out.push_back(text.substr(at, end - at));
    at = text.find_first_not_of('\n', end);
    if (at == std::string::npos) break;
  }
  return out;
}

TokenSplit split_document_tokens(const std::vector<std::vector<int64_t>>& documents,
                                 double val_fraction, int64_t seq_len) {
  std::vector<int64_t> tokens, starts;
  for (const auto& d : documents) {
    if (d.empty()) continue;
    starts.push_back(static_cast<int64_t>(tokens.size()));
    tokens.insert(tokens.end(), d.begin(), d.end());
  }
  TokenSplit split = split_tokens(std::move(tokens), val_fraction, seq_len);
  const auto cut = static_cast<int64_t>(split.train.size());
  split.val_starts.push_back(0);
  for (int64_t s : starts) {
    if (s < cut) split.train_starts.push_back(s);
    if (s > cut) split.val_starts.push_back(s - cut);
  }
  return split;
}

BatchSampler::BatchSampler(const std::vector<int64_t>* tokens, int64_t batch_size, int64_t seq_len,
                           uint64_t seed, uint64_t stream,
                           const std::vector<int64_t>* document_starts)
    : tokens_(tokens),
      batch_size_(batch_size),
      seq_len_(seq_len),
      seed_(seed),
      stream_(stream),
      starts_(document_starts) {
  const auto n = static_cast<int64_t>(tokens_->size());
  if (n < seq_len_ + 1) {
    throw std::runtime_error("BatchSampler: " + std::to_string(tokens_->size()) +
                             " tokens cannot hold a window of " + std::to_string(seq_len_ + 1));
  }
  if (starts_) {
    usable_starts_ =
        std::upper_bound(starts_->begin(), starts_->end(), n - seq_len_ - 1) - starts_->begin();
    if (usable_starts_ == 0)
      throw std::runtime_error("--pack-documents: no document starts " +
                               std::to_string(seq_len_ + 1) +
                               " tokens before the end of the text (use a smaller --seq-len)");
  }
}

int64_t BatchSampler::offset(int64_t step, int64_t row) const {
  const uint64_t h = mix(mix(mix(mix(seed_) ^ stream_) ^ static_cast<uint64_t>(step)) ^
                         static_cast<uint64_t>(row));
  if (starts_) return (*starts_)[h % static_cast<uint64_t>(usable_starts_)];
  const uint64_t starts = tokens_->size() - static_cast<uint64_t>(seq_len_);  // >= 1
  return static_cast<int64_t>(h % starts);
}

Batch BatchSampler::get(int64_t step) const {
  auto inputs = at::empty({batch_size_, seq_len_}, at::kLong);
  auto targets = at::empty({batch_size_, seq_len_}, at::kLong);
  at::Tensor documents = starts_ ? at::empty({batch_size_, seq_len_}, at::kLong) : at::Tensor();
  auto* in = inputs.data_ptr<int64_t>();
  auto* tg = targets.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch_size_; ++b) {
    const int64_t first = offset(step, b);
    const int64_t* src = tokens_->data() + first;
    std::copy(src, src + seq_len_, in + b * seq_len_);
    std::copy(src + 1, src + 1 + seq_len_, tg + b * seq_len_);
    if (!starts_) continue;
    // Each token's document; a token followed by another document's start predicts nothing.
    auto* doc = documents.data_ptr<int64_t>() + b * seq_len_;
    auto next = std::upper_bound(starts_->begin(), starts_->end(), first);
    int64_t id = 0;
    for (int64_t i = 0; i < seq_len_; ++i) {
      doc[i] = id;
      if (next != starts_->end() && *next == first + i + 1) {
        tg[b * seq_len_ + i] = -100;
        ++id;
        ++next;
      }
    }
  }
  return {inputs, targets, documents};
}

}  // namespace dtensor::train
