#pragma once
// Counts the collectives issued while active, by type and by module, as PyTorch's
// CommDebugMode does.
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <ostream>
#include <string>
#include <unordered_set>
#include <vector>

namespace dtensor {

/// The collectives CommDebugMode counts (PyTorch's c10d_functional ops of the same names).
enum class CommType : uint8_t {
  all_reduce,              ///< comm::all_reduce / all_reduce_async.
  all_gather_into_tensor,  ///< comm::all_gather_into_tensor / its async form.
  reduce_scatter_tensor,   ///< comm::reduce_scatter_tensor / its async form.
  all_to_all_single,       ///< comm::all_to_all_single.
  broadcast,               ///< comm::broadcast.
  scatter,                 ///< comm::scatter.
  send,                    ///< comm::send / isend (point-to-point; counted on the sender).
  recv,                    ///< comm::recv / irecv (counted on the receiver).
};
/// The key PyTorch's tests use, e.g. "c10d_functional.all_reduce".
const char* comm_type_name(CommType t);
/// Prints comm_type_name(t).
std::ostream& operator<<(std::ostream& os, CommType t);

/// One collective as CommDebugMode saw it.
struct CommRecord {
  CommType type;       ///< Which collective.
  int64_t bytes;       // payload this rank contributed
  int mesh_dim;        // -1 when the group is not a mesh dimension
  int group_size;      ///< Number of ranks in the group.
  std::string module;  // innermost module FQN being run ("" outside any tracked module)
  bool backward;       // issued while the autograd engine runs a backward pass
  /// The tracked modules around the collective, outermost first, ending with `module`
  /// (filled in by CommDebugMode::record).
  std::vector<std::string> module_path = {};
};

/// Number of collectives per type.
using CommCounts = std::map<CommType, int64_t>;
/// fqn -> "forward" | "backward" -> counts.
using CommModuleCounts = std::map<std::string, std::map<std::string, CommCounts>>;

/// Active from construction until destruction (or exit()); enter() clears and re-activates,
/// so one object can give per-block counts. Several may be active at once; all count.
///
/// Per-module counts: while a CommDebugMode is active, modules deriving from
/// tp::HookedModule (dtensor::nn layers and dtensor::nn::Module) are tracked as PyTorch's
/// ModTracker does. The outermost module called names its submodules by path ("layers.0.wq",
/// the names of named_parameters() and parallelize plans), so unlike PyTorch the keys are not
/// prefixed with the root's class name; "Global" holds everything. A collective issued in
/// backward counts for the module whose forward built that part of the graph, provided the
/// forward ran while a CommDebugMode was active (the backward brackets are installed then).
class CommDebugMode {
 public:
  /// Starts counting (calls enter()).
  CommDebugMode();
  /// Stops counting (calls exit()).
  ~CommDebugMode();
  CommDebugMode(const CommDebugMode&) = delete;
  CommDebugMode& operator=(const CommDebugMode&) = delete;

  void enter();  // clear and start counting
  void exit();   // stop counting (counts stay readable)

  /// Total number of collectives of each type recorded since enter().
  CommCounts get_comm_counts() const;
  /// Total number of collectives recorded since enter(), all types.
  int64_t get_total_counts() const;
  /// Every collective recorded since enter(), in issue order.
  std::vector<CommRecord> records() const;
  /// Per-module forward/backward counts: each collective counts for "Global" and for every
  /// tracked module around it (parents include their children). Only modules that saw a
  /// collective appear.
  CommModuleCounts comm_module_counts() const;
  /// A readable table of counts (and bytes) by collective type.
  std::string table() const;
  /// One row per module (Global first, submodules indented under their parents, in the order
  /// they ran), forward and backward counts per collective type.
  std::string module_table() const;
  /// Tracked modules whose forward ran while active, in order of first call.
  std::vector<std::string> modules() const;

  /// Called by the comm layer for every collective.
  static void record(const CommRecord& r);
  /// Whether any CommDebugMode is active (module tracking costs nothing otherwise).
  static bool any_active() { return active_count_.load(std::memory_order_relaxed) > 0; }
  /// Called by the module tracker when a tracked module's forward starts.
  static void note_module(const std::string& fqn);

 private:
  mutable std::mutex mu_;
  std::vector<CommRecord> records_;
  std::vector<std::string> modules_;
  std::unordered_set<std::string> module_set_;
  bool active_ = false;
  static std::atomic<int> active_count_;
};

std::string format_comm_counts(const CommCounts& counts);  // "{all_reduce: 1, ...}"

/// The module being run, for per-module counts (maintained by the TP layer's module tracker).
/// Forward: a thread-local stack of scopes. Backward: per autograd graph task, a stack kept by
/// gradient hooks: enter_backward(fqn) when the gradient of the module's output arrives,
/// exit_backward(fqn) when the gradients of its inputs are complete (PyTorch's ModTracker).
class ModuleScope {
 public:
  /// Pushes `fqn` onto this thread's forward module stack; the destructor pops it.
  explicit ModuleScope(const std::string& fqn);
  /// Pops the scope pushed by the constructor.
  ~ModuleScope();
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;

  static std::string current();  // innermost named module ("" if none)
  /// The named modules around the running code, outermost first.
  static std::vector<std::string> current_path();
  static bool empty();  // no forward scope on this thread

  /// Entering a module's backward pops the modules that are not its ancestors (by path), so a
  /// module whose inputs need no gradient, and hence never exits, is left when a sibling or
  /// the parent's remainder starts. No-ops outside a backward pass.
  static void enter_backward(const std::string& fqn);
  /// Leaves `fqn`'s backward scope (and what was entered after it); no-op outside backward.
  static void exit_backward(const std::string& fqn);
};

/// Set while our backward code paths run; backward() also reports any code the autograd
/// engine runs (a collective inside a backward pass counts as backward).
class BackwardScope {
 public:
  /// Marks this thread as running backward code until destruction (nests).
  BackwardScope();
  /// Restores the previous state.
  ~BackwardScope();
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;
  /// Whether in a BackwardScope on this thread or inside an autograd backward pass.
  static bool active();

 private:
  bool prev_;
};

}  // namespace dtensor
