#pragma once
// Counts the collectives issued while active, by type, as PyTorch's CommDebugMode does.
#include <cstdint>
#include <map>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

namespace dtensor {

enum class CommType : uint8_t {
  all_reduce,
  all_gather_into_tensor,
  reduce_scatter_tensor,
  all_to_all_single,
  broadcast,
  scatter,
};
// The key PyTorch's tests use, e.g. "c10d_functional.all_reduce".
const char* comm_type_name(CommType t);
std::ostream& operator<<(std::ostream& os, CommType t);

struct CommRecord {
  CommType type;
  int64_t bytes;     // payload this rank contributed
  int mesh_dim;      // -1 when the group is not a mesh dimension
  int group_size;
  std::string module;  // innermost module FQN being run ("" outside any tracked module)
  bool backward;       // issued while running backward
};

using CommCounts = std::map<CommType, int64_t>;

// Active from construction until destruction (or exit()); enter() clears and re-activates,
// so one object can give per-block counts. Several may be active at once; all count.
class CommDebugMode {
 public:
  CommDebugMode();
  ~CommDebugMode();
  CommDebugMode(const CommDebugMode&) = delete;
  CommDebugMode& operator=(const CommDebugMode&) = delete;

  void enter();  // clear and start counting
  void exit();   // stop counting (counts stay readable)

  CommCounts get_comm_counts() const;
  int64_t get_total_counts() const;
  std::vector<CommRecord> records() const;
  // Per-module forward/backward counts; parents include their children. Root key "Global".
  std::map<std::string, std::map<std::string, CommCounts>> comm_module_counts() const;
  // A readable table of counts (and bytes) by collective type.
  std::string table() const;

  // Called by the comm layer for every collective.
  static void record(const CommRecord& r);

 private:
  mutable std::mutex mu_;
  std::vector<CommRecord> records_;
  bool active_ = false;
};

std::string format_comm_counts(const CommCounts& counts);  // "{all_reduce: 1, ...}"

// Tracking of the module being run, for per-module counts (maintained by the TP layer).
class ModuleScope {
 public:
  explicit ModuleScope(const std::string& fqn);
  ~ModuleScope();
  static std::string current();
};
// Set while the autograd engine runs our backward code paths.
class BackwardScope {
 public:
  BackwardScope();
  ~BackwardScope();
  static bool active();

 private:
  bool prev_;
};

}  // namespace dtensor
