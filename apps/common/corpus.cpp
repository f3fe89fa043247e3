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

BatchSampler::BatchSampler(const std::vector<int64_t>* tokens, int64_t batch_size, int64_t seq_len,
                           uint64_t seed, uint64_t stream)
    : tokens_(tokens), batch_size_(batch_size), seq_len_(seq_len), seed_(seed), stream_(stream) {
  if (static_cast<int64_t>(tokens_->size()) < seq_len_ + 1) {
    throw std::runtime_error("BatchSampler: " + std::to_string(tokens_->size()) +
                             " tokens cannot hold a window of " + std::to_string(seq_len_ + 1));
  }
}

int64_t BatchSampler::offset(int64_t step, int64_t row) const {
  const uint64_t h = mix(mix(mix(mix(seed_) ^ stream_) ^ static_cast<uint64_t>(step)) ^
                         static_cast<uint64_t>(row));
  const uint64_t starts = tokens_->size() - static_cast<uint64_t>(seq_len_);  // >= 1
  return static_cast<int64_t>(h % starts);
}

Batch BatchSampler::get(int64_t step) const {
  auto inputs = at::empty({batch_size_, seq_len_}, at::kLong);
  auto targets = at::empty({batch_size_, seq_len_}, at::kLong);
  auto* in = inputs.data_ptr<int64_t>();
  auto* tg = targets.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch_size_; ++b) {
    const int64_t* src = tokens_->data() + offset(step, b);
    std::copy(src, src + seq_len_, in + b * seq_len_);
    std::copy(src + 1, src + 1 + seq_len_, tg + b * seq_len_);
  }
  return {inputs, targets};
}

}  // namespace dtensor::train
