#include "dtensor/checkpoint/checkpoint_manager.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

#include "dtensor/checkpoint/rank0_outcome.h"
#include "dtensor/util/atomic_file.h"
#include "dtensor/util/error_message.h"

namespace dtensor::checkpoint {
namespace fs = std::filesystem;
namespace {

constexpr const char* kLatest = "latest";
const std::regex kCheckpointName(R"(step_(\d+)\.safetensors)");
const std::regex kTemporaryName(R"((step_\d+\.safetensors|latest)\.tmp-\d+)");

}  // namespace

CheckpointManager::CheckpointManager(std::string dir, int keep_last)
    : dir_(std::move(dir)), keep_last_(keep_last) {
  TORCH_CHECK(keep_last_ >= 1, "CheckpointManager: keep_last must be at least 1, got ", keep_last_);
  std::error_code ec;
  fs::create_directories(dir_, ec);  // every rank may race here; only the result matters
  TORCH_CHECK(fs::is_directory(dir_), "CheckpointManager: cannot create directory '", dir_,
              "': ", ec.message());
}

std::string CheckpointManager::path_for(int64_t step) const {
  TORCH_CHECK(step >= 0, "CheckpointManager: step must be non-negative, got ", step);
  char name[48];
  std::snprintf(name, sizeof(name), "step_%06" PRId64 ".safetensors", step);
  return (fs::path(dir_) / name).string();
}

std::vector<std::pair<int64_t, std::string>> CheckpointManager::list() const {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() && std::regex_match(name, m, kCheckpointName)) {
      out.emplace_back(std::stoll(m[1].str()), e.path().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<std::string> CheckpointManager::latest() const {
  std::ifstream in(fs::path(dir_) / kLatest);
  std::string name;
  if (!in || !std::getline(in, name) || !std::regex_match(name, kCheckpointName)) {
    return std::nullopt;
  }
  const fs::path p = fs::path(dir_) / name;
  if (!fs::exists(p)) return std::nullopt;
  return p.string();
}

void CheckpointManager::point_latest_at(const std::string& file_name) const {
  util::write_file_atomically((fs::path(dir_) / kLatest).string(), file_name + "\n",
                              "CheckpointManager");
}

void CheckpointManager::prune(int64_t newest_step) const {
  std::vector<std::pair<int64_t, std::string>> older;
  for (auto& c : list()) {
    if (c.first <= newest_step) older.push_back(std::move(c));
  }
  // Files with larger steps belong to a run that was restarted from an earlier checkpoint;
  // they are left alone.
  const size_t keep = static_cast<size_t>(keep_last_);
  for (size_t i = 0; i + keep < older.size(); ++i) fs::remove(older[i].second);
  // Temporaries of writers that died (a crash mid-save); ours are renamed or gone by now.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    if (std::regex_match(e.path().filename().string(), kTemporaryName)) {
      fs::remove(e.path(), ec);
    }
  }
}

std::string CheckpointManager::save(int64_t step, const torch::nn::Module& module,
                                    torch::optim::Optimizer* optimizer, SaveOptions options) {
  options.step = step;
  const std::string path = path_for(step);
  save_checkpoint(path, module, optimizer, options);
  std::exception_ptr error;
  if (detail::global_rank() == 0) {
    try {
      try {
        verify_checkpoint(path);
      } catch (...) {
        fs::remove(path);  // never let a bad file become "latest" or displace a good one
        throw;
      }
      point_latest_at(fs::path(path).filename().string());
      prune(step);
    } catch (...) {
      error = std::current_exception();
    }
  }
  detail::share_rank0_outcome(
      error, "CheckpointManager::save(step " + std::to_string(step) + ") in '" + dir_ + "'");
  return path;
}

std::optional<CheckpointMetadata> CheckpointManager::load_latest(torch::nn::Module& module,
                                                                 torch::optim::Optimizer* optimizer,
                                                                 const LoadOptions& options,
                                                                 const SkipFn& on_skip) const {
  const auto all = list();
  std::vector<std::string> candidates;
  const auto newest = latest();
  int64_t limit = INT64_MAX;
  if (newest) {
    candidates.push_back(*newest);
    for (const auto& [s, p] : all) {
      if (p == *newest) limit = s;
    }
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->first <= limit && (!newest || it->second != *newest)) candidates.push_back(it->second);
  }
  if (candidates.empty()) return std::nullopt;

  std::string reasons;
  for (const auto& path : candidates) {
    try {
      verify_checkpoint(path);
    } catch (const c10::Error& e) {
      const std::string why = util::error_message(e);
      reasons += "\n  " + why;
      if (on_skip) {
        on_skip(path, why);
      } else if (detail::global_rank() == 0) {
        TORCH_WARN("CheckpointManager: skipping '", path, "': ", why);
      }
      continue;
    }
    LoadOptions checked = options;
    checked.verify_checksums = false;  // just done
    return load_checkpoint(path, module, optimizer, checked);
  }
  TORCH_CHECK(false, "CheckpointManager: no intact checkpoint in '", dir_, "':", reasons);
}

}  // namespace dtensor::checkpoint
