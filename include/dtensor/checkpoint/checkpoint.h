#pragma once
// Checkpoints of modules whose parameters may be DTensors, as safetensors files that hold the
// global (unsharded) tensors: a checkpoint saved at one TP degree loads at any other, and
// opens in Python (`safetensors.torch.load_file`).
//
//   save_checkpoint("ckpt.safetensors", *model, &optimizer, {.config = cfg_json, .step = 100});
//   auto meta = load_checkpoint("ckpt.safetensors", *model, &optimizer);  // any TP degree
//
// File contents: each parameter and buffer under its name ("layers.0.attention.wq.weight");
// the optimizer state under "optim.state.<parameter name>.<key>" (Adam/AdamW and
// dtensor::optim::CapturableAdamW, which saves as AdamW: exp_avg,
// exp_avg_sq, max_exp_avg_sq, step; SGD: momentum_buffer); and __metadata__ entries
// (checkpoint_keys): "format": "pt" (as Hugging Face writes), our format name and version, the
// caller's config string, step, the TP degree and world size that saved it, each DTensor's
// placements ("Shard(dim=0)"), each tensor's CRC-32C, the optimizer's type and param-group
// options, the caller's own entries, and a CRC-32C of all of that and of the tensor table
// (names, dtypes, shapes, offsets), so that no damage to the header loads silently.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace dtensor::checkpoint {

// Metadata keys this library writes; SaveOptions::metadata may not use them.
namespace checkpoint_keys {
inline constexpr const char* kFormat = "format";  // "pt": the tensors are torch tensors
inline constexpr const char* kCheckpointFormat = "checkpoint_format";  // "dtensor-checkpoint"
/// Key: kCheckpointFormatVersion, in decimal.
inline constexpr const char* kFormatVersion = "format_version";
/// Key: SaveOptions::config.
inline constexpr const char* kConfig = "config";
/// Key: the training step, in decimal.
inline constexpr const char* kStep = "step";
/// Key: tensor-parallel degree of the run that saved the file.
inline constexpr const char* kTpDegree = "tp_degree";
/// Key: number of ranks of the run that saved the file.
inline constexpr const char* kWorldSize = "world_size";
inline constexpr const char* kMesh = "mesh";              // the first DTensor's mesh, printed
inline constexpr const char* kPlacements = "placements";  // JSON {name: "Shard(dim=0)"}
inline constexpr const char* kChecksumAlgorithm = "checksum_algorithm";  // "crc32c"
inline constexpr const char* kChecksums = "checksums";                   // JSON {name: "1a2b3c4d"}
inline constexpr const char* kOptimizer = "optimizer";  // JSON {type, param_groups}
/// CRC-32C ("1a2b3c4d") of every other metadata entry and of each tensor's name, dtype, shape
/// and offsets, in a canonical form (see checkpoint.cpp).
inline constexpr const char* kHeaderChecksum = "header_checksum";
}  // namespace checkpoint_keys

/// Version 1 (format "dtensor-checkpoint", no header checksum) is refused: damage to its
/// metadata cannot be detected. Its tensors still read with safetensors::load_file.
inline constexpr int64_t kCheckpointFormatVersion = 2;

/// Options of save_checkpoint (designated initializers: `{.config = ..., .step = ...}`).
struct SaveOptions {
  std::string config;                           // the model configuration, opaque to us (e.g. JSON)
  int64_t step = 0;                             ///< Training step recorded in the metadata.
  std::map<std::string, std::string> metadata;  // more entries of the caller's
  bool include_buffers = true;  ///< Also save the module's buffers, not only its parameters.
  /// Called on rank 0 after each tensor reaches the file: name, 0-based index, count.
  /// An exception thrown here aborts the save (the previous file at `path` stays).
  std::function<void(const std::string& name, size_t index, size_t count)> on_tensor_written;
};

/// Saves `module` (and the optimizer's state when given) to `path`. Collective: every rank
/// calls it; DTensors are gathered with full_tensor (all ranks take part), global rank 0 writes
/// the file atomically (a temporary, fsync, rename), and all ranks return once the file is
/// complete, or all throw if rank 0 failed, leaving any previous file at `path` intact.
/// Global rank 0 must be in the mesh of every DTensor.
void save_checkpoint(const std::string& path, const torch::nn::Module& module,
                     torch::optim::Optimizer* optimizer = nullptr, const SaveOptions& options = {});

/// What a checkpoint's metadata says about it; returned by load_checkpoint.
struct CheckpointMetadata {
  std::string config;          ///< SaveOptions::config as saved.
  int64_t step = 0;            ///< Training step as saved.
  int64_t tp_degree = 1;       ///< Tensor-parallel degree of the run that saved it.
  int64_t world_size = 1;      ///< World size of the run that saved it.
  int64_t format_version = 0;  // 0: a safetensors file not written by save_checkpoint
  std::map<std::string, std::string> entries;  // the whole __metadata__
  /// Set by load_checkpoint: names of the module (and of the optimizer's state) absent from the
  /// file, and names in the file the module does not have (optimizer state counts only when an
  /// optimizer is given). A strict load fails instead, so both are empty after it.
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;  ///< See missing_keys.
};

/// Options of load_checkpoint.
struct LoadOptions {
  /// Names in the module but not the file (or the reverse) are errors; false skips them and
  /// reports them in missing_keys / unexpected_keys, but a load that matches no name at all
  /// is still an error.
  bool strict = true;
  /// Check every loaded tensor's CRC-32C against the metadata (files we wrote).
  bool verify_checksums = true;
};

/// Loads `path` into the existing parameters and buffers of `module` (and the optimizer
/// state), at any TP degree: every DTensor receives its local chunk for its current
/// placements, without communication. Each rank reads the file. Everything is read and checked
/// first — header and its checksum, tensor checksums, names and shapes (errors list every missing,
/// unexpected and mismatched tensor and name the file) — and only then copied in place, so on error
/// the module and optimizer are unchanged; parameters stay the same objects, so an optimizer built
/// on them keeps working. The optimizer state is keyed by parameter name; its param groups must
/// hold the same parameters as when saved; their options (lr, ...) are restored.
CheckpointMetadata load_checkpoint(const std::string& path, torch::nn::Module& module,
                                   torch::optim::Optimizer* optimizer = nullptr,
                                   const LoadOptions& options = {});

/// The metadata alone (e.g. the config to build the model before loading it), after checking
/// the header checksum of files save_checkpoint wrote.
CheckpointMetadata read_checkpoint_metadata(const std::string& path);

/// Checks the header checksum, then reads every tensor and checks its checksum; throws naming
/// the file and the damaged part (the header or the first bad tensor).
void verify_checkpoint(const std::string& path);

}  // namespace dtensor::checkpoint
