#pragma once
// The safetensors file format (https://huggingface.co/docs/safetensors), written and read by
// our own code so that checkpoints open in Python's `safetensors` and `torch`:
//
//   8 bytes   N, the header length (unsigned, little-endian)
//   N bytes   JSON object: {"__metadata__": {string: string}, "<name>": {"dtype": "F32",
//             "shape": [2, 3], "data_offsets": [begin, end]}, ...}, padded with spaces so
//             the data starts at a multiple of 8
//   the data  every tensor's bytes, row-major, little-endian; offsets are relative to the
//             start of the data, and the tensors cover it without gaps or overlaps
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor::checkpoint::safetensors {

/// The header's "__metadata__" object: string keys to string values.
using Metadata = std::map<std::string, std::string>;

/// "F32", "F64", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL". Throws for other
/// dtypes (complex, quantized, ...), naming the dtype and the ones supported.
std::string dtype_name(c10::ScalarType dtype);
c10::ScalarType dtype_from_name(std::string_view name);  // throws for unknown names

/// One tensor as the header describes it.
struct TensorInfo {
  std::string name;                                ///< Tensor name (key in the header).
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< Element type.
  std::vector<int64_t> shape;                      ///< Sizes, outermost first.
  uint64_t begin = 0;                              // byte offsets relative to the start of the data
  uint64_t end = 0;  ///< One past the last byte, relative to the start of the data.
  uint64_t nbytes() const { return end - begin; }  ///< Size of the data in bytes.
};

/// Writes a file one tensor at a time, so the caller needs only one tensor in memory.
///
/// The constructor declares every tensor and reserves the header for `metadata`; finish()
/// writes the final metadata into that space, so the final values must not serialize longer
/// (give fixed-width placeholders, e.g. checksums of zeros, for values known only at the end).
/// The data goes to "<path>.tmp-<pid>"; finish() flushes it to disk and renames it over
/// `path`, so readers see either the previous file or the complete new one. A writer
/// destroyed before finish() (an exception) deletes its temporary and leaves `path` alone.
class Writer {
 public:
  /// A tensor to be written: name, dtype and shape.
  struct Entry {
    std::string name;            ///< Tensor name.
    c10::ScalarType dtype;       ///< Element type.
    std::vector<int64_t> shape;  ///< Sizes.
  };
  /// Creates the temporary file and declares every tensor, in write order; throws on I/O errors.
  Writer(std::string path, const std::vector<Entry>& entries, const Metadata& metadata);
  /// Deletes the temporary file unless finish() succeeded.
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  /// Appends the next declared tensor (its dtype and shape must match the declaration). Any
  /// device and layout: it is copied to contiguous CPU memory first when needed.
  void write(const at::Tensor& tensor);
  /// Writes the header with `metadata`, syncs and renames. Every tensor must have been written.
  void finish(const Metadata& metadata);

  /// The declared tensors with their offsets.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// Where the data goes until finish() renames it ("<path>.tmp-<pid>").
  const std::string& temporary_path() const { return tmp_path_; }

 private:
  std::string header(const Metadata& metadata) const;
  void write_bytes(const void* data, size_t size);

  std::string path_;
  std::string tmp_path_;
  std::vector<TensorInfo> tensors_;
  size_t header_size_ = 0;  // reserved, a multiple of 8
  size_t next_ = 0;
  int fd_ = -1;
  bool finished_ = false;
};

/// A safetensors file mapped read-only. Opening checks the header: its length against the
/// file size, JSON syntax, known dtypes, offsets that match each shape and cover the data
/// exactly (a truncated file or trailing bytes are errors). Every error names the file.
class File {
 public:
  /// Maps `path` and checks its header; throws naming the file on any error.
  explicit File(const std::string& path);
  /// Unmaps the file; tensors from view() and spans from bytes() become invalid.
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }       ///< The file's path as given.
  const Metadata& metadata() const { return metadata_; }  ///< The header's "__metadata__".
  /// In file order (increasing offsets).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;  // nullptr when absent
  const TensorInfo& at(const std::string& name) const;    // throws naming the file when absent

  /// The tensor's raw bytes in the mapping (valid while this File lives).
  std::span<const std::byte> bytes(const TensorInfo& info) const;
  /// A CPU tensor owning a copy of the data.
  at::Tensor tensor(const TensorInfo& info) const;
  /// tensor(at(name)): throws when absent.
  at::Tensor tensor(const std::string& name) const { return tensor(at(name)); }
  /// A CPU tensor over the mapping without a copy when the data is suitably aligned (it is
  /// in files we write), otherwise a copy. Valid while this File lives.
  at::Tensor view(const TensorInfo& info) const;
  /// A CPU tensor holding the block [offset[d], offset[d] + size[d]) of every dimension, copied
  /// from the mapping run by run: only the block's bytes are touched (pages outside it are never
  /// read), so a rank of a sharded load reads just its part. Its byte count is what was read.
  at::Tensor slice(const TensorInfo& info, c10::IntArrayRef offset, c10::IntArrayRef size) const;

  uint64_t data_offset() const { return data_offset_; }  // in the file: 8 + header length
  uint64_t file_size() const { return size_; }           ///< Size of the whole file in bytes.

 private:
  std::string path_;
  Metadata metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  const std::byte* map_ = nullptr;
  uint64_t size_ = 0;
  uint64_t data_offset_ = 0;
};

/// Like Python's safetensors.torch.save_file / load_file.
void save_file(const std::map<std::string, at::Tensor>& tensors, const std::string& path,
               const Metadata& metadata = {});
/// Every tensor of `path` as CPU tensors owning their data (copies), keyed by name.
std::map<std::string, at::Tensor> load_file(const std::string& path);

}  // namespace dtensor::checkpoint::safetensors
