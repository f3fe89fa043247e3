#pragma once
// Periodic checkpoints in one directory: step_000100.safetensors, ... and a "latest" file
// naming the newest good one, keeping the last N.
//
//   CheckpointManager ckpt("runs/a/checkpoints", /*keep_last=*/3);
//   if (auto meta = ckpt.load_latest(*model, &opt)) start = meta->step;  // resume
//   ...
//   if (step % 100 == 0) ckpt.save(step, *model, &opt, {.config = cfg_json});
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/checkpoint/checkpoint.h"

namespace dtensor::checkpoint {

/// Keeps periodic checkpoints of one run in a directory, with a "latest" pointer and pruning.
class CheckpointManager {
 public:
  /// Creates `dir` when needed. keep_last >= 1.
  explicit CheckpointManager(std::string dir, int keep_last = 3);

  const std::string& dir() const { return dir_; }  ///< The checkpoint directory.
  int keep_last() const { return keep_last_; }     ///< How many checkpoints are kept.
  std::string path_for(int64_t step) const;        // <dir>/step_000100.safetensors

  /// Collective, like save_checkpoint (options.step is set to `step`). Then rank 0 reads the
  /// new file back and checks every checksum, points "latest" at it (atomically) and deletes
  /// the oldest checkpoints with smaller steps beyond keep_last. If the save or the check
  /// fails, every rank throws, and "latest" and the older checkpoints are as they were.
  /// Returns the new file's path.
  std::string save(int64_t step, const torch::nn::Module& module,
                   torch::optim::Optimizer* optimizer = nullptr, SaveOptions options = {});

  /// Checkpoint files in the directory by increasing step.
  std::vector<std::pair<int64_t, std::string>> list() const;
  /// The file "latest" names, when both exist.
  std::optional<std::string> latest() const;

  /// Loads the checkpoint "latest" names or, when it is missing or fails its checksums, the
  /// newest older one that passes (on_skip hears each file skipped and why; by default a
  /// warning). nullopt when the directory holds no checkpoint; throws when none is intact.
  /// Errors that are not the file's fault (a module that does not fit) are thrown at once.
  using SkipFn = std::function<void(const std::string& path, const std::string& reason)>;
  std::optional<CheckpointMetadata> load_latest(torch::nn::Module& module,
                                                torch::optim::Optimizer* optimizer = nullptr,
                                                const LoadOptions& options = {},
                                                const SkipFn& on_skip = nullptr) const;

 private:
  void point_latest_at(const std::string& file_name) const;
  void prune(int64_t newest_step) const;

  std::string dir_;
  int keep_last_;
};

}  // namespace dtensor::checkpoint
