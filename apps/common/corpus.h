#pragma once
// Training text: the built-in corpus or a file, split into train and validation tokens, and
// the deterministic batch sampler.
//
// Batches are a pure function of (seed, step): every rank computes the same batch without
// communicating, a resumed run draws the same batches as an uninterrupted one, and a run at
// any TP degree (or the single-device check) sees the same data.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtensor::train {

// The default corpus: about 300 KB of English prose generated from a small grammar with a
// fixed seed (the same text on every machine and every run; no download).
const std::string& default_corpus();

// The whole content of a text file; throws with the path when it cannot be read.
std::string read_text_file(const std::string& path);

// Tokens of a corpus split into a training part and a held-out validation tail.
struct TokenSplit {
  std::vector<int64_t> train;
  std::vector<int64_t> val;
  // --pack-documents: where each document starts in train and in val (ascending; val's first
  // document is the piece of one the split cut, from 0); empty otherwise.
  std::vector<int64_t> train_starts, val_starts;
};
// The last `val_fraction` of the tokens (at least seq_len + 1 of them) become validation.
// Throws when the text is too short to give both parts a window of seq_len + 1 tokens.
TokenSplit split_tokens(std::vector<int64_t> tokens, double val_fraction, int64_t seq_len);

// The documents of a text: its paragraphs, split at blank lines (empty ones dropped).
std::vector<std::string> split_documents(const std::string& text);

// split_tokens of the documents' tokens one after another, with where each document starts.
TokenSplit split_document_tokens(const std::vector<std::vector<int64_t>>& documents,
                                 double val_fraction, int64_t seq_len);

// One batch: inputs [B, T] and the next-token targets [B, T] (int64).
struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
  // --pack-documents: [B, T] int64, each token's document (0, 1, ... along its row); a
  // document's last token has target -100 (ignored). Undefined: every row one sequence.
  at::Tensor documents = {};
};

// Draws batches of `batch_size` windows of `seq_len + 1` tokens at offsets derived from
// (seed, stream, step, row) with a counter-based hash, so no generator state exists. With
// `document_starts` (ascending offsets into `tokens`), each window begins at a document's start
// and the batch carries its documents (Batch::documents): packed documents, boundaries kept.
class BatchSampler {
 public:
  BatchSampler(const std::vector<int64_t>* tokens, int64_t batch_size, int64_t seq_len,
               uint64_t seed, uint64_t stream,
               const std::vector<int64_t>* document_starts = nullptr);
  Batch get(int64_t step) const;
  // The window start of one row (exposed for tests).
  int64_t offset(int64_t step, int64_t row) const;

 private:
  const std::vector<int64_t>* tokens_;
  int64_t batch_size_;
  int64_t seq_len_;
  uint64_t seed_;
  uint64_t stream_;
  const std::vector<int64_t>* starts_;  // null: windows anywhere
  int64_t usable_starts_ = 0;           // the starts that leave a whole window
};

// Stream ids: training batches and validation batches never coincide.
inline constexpr uint64_t kTrainStream = 1;
inline constexpr uint64_t kValStream = 2;

}  // namespace dtensor::train
