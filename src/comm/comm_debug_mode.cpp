#include "dtensor/comm/comm_debug_mode.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <functional>
#include <iomanip>
#include <iterator>
#include <sstream>
#include <unordered_map>

namespace dtensor {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<CommDebugMode*>& active_modes() {
  static std::vector<CommDebugMode*> v;
  return v;
}
thread_local std::vector<std::string> tl_module_stack;
thread_local bool tl_backward = false;

// Backward module stacks by autograd graph task: the engine may run one task's nodes on
// several threads (one per device), so these are not thread-local.
std::mutex& backward_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<int, std::vector<std::string>>& backward_stacks() {
  static std::unordered_map<int, std::vector<std::string>> m;
  return m;
}

// "a" is a proper ancestor of "a.b" (not of "ab").
bool is_ancestor(const std::string& a, const std::string& fqn) {
  return fqn.size() > a.size() && fqn.compare(0, a.size(), a) == 0 && fqn[a.size()] == '.';
}

std::string short_name(CommType t) {
  std::string s = comm_type_name(t);
  return s.substr(s.find('.') + 1);
}

}  // namespace

std::atomic<int> CommDebugMode::active_count_{0};

const char* comm_type_name(CommType t) {
  // Indexed by CommType, in its declaration order.
  static constexpr const char* kNames[] = {"c10d_functional.all_reduce",
                                           "c10d_functional.all_gather_into_tensor",
                                           "c10d_functional.reduce_scatter_tensor",
                                           "c10d_functional.all_to_all_single",
                                           "c10d_functional.broadcast",
                                           "c10d.scatter_",
                                           "c10d.send",
                                           "c10d.recv_"};
  static_assert(std::size(kNames) == static_cast<size_t>(CommType::recv) + 1);
  const auto i = static_cast<size_t>(t);
  return i < std::size(kNames) ? kNames[i] : "?";
}

std::ostream& operator<<(std::ostream& os, CommType t) { return os << comm_type_name(t); }

CommDebugMode::CommDebugMode() { enter(); }

CommDebugMode::~CommDebugMode() { exit(); }

void CommDebugMode::enter() {
  {
    std::lock_guard<std::mutex> l(mu_);
    records_.clear();
    modules_.clear();
    module_set_.clear();
  }
  std::lock_guard<std::mutex> g(registry_mutex());
  if (!active_) {
    active_modes().push_back(this);
    active_ = true;
    ++active_count_;
  }
}

void CommDebugMode::exit() {
  std::lock_guard<std::mutex> g(registry_mutex());
  if (active_) {
    auto& v = active_modes();
    v.erase(std::remove(v.begin(), v.end(), this), v.end());
    active_ = false;
    --active_count_;
  }
}

void CommDebugMode::record(const CommRecord& r) {
  CommRecord rec = r;
  if (rec.module_path.empty()) rec.module_path = ModuleScope::current_path();
  std::lock_guard<std::mutex> g(registry_mutex());
  for (CommDebugMode* m : active_modes()) {
    std::lock_guard<std::mutex> l(m->mu_);
    m->records_.push_back(rec);
  }
}

void CommDebugMode::note_module(const std::string& fqn) {
  std::lock_guard<std::mutex> g(registry_mutex());
  for (CommDebugMode* m : active_modes()) {
    std::lock_guard<std::mutex> l(m->mu_);
    if (m->module_set_.insert(fqn).second) m->modules_.push_back(fqn);
  }
}

CommCounts CommDebugMode::get_comm_counts() const {
  std::lock_guard<std::mutex> l(mu_);
  CommCounts c;
  for (const auto& r : records_) ++c[r.type];
  return c;
}

int64_t CommDebugMode::get_total_counts() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int64_t>(records_.size());
}

std::vector<CommRecord> CommDebugMode::records() const {
  std::lock_guard<std::mutex> l(mu_);
  return records_;
}

std::vector<std::string> CommDebugMode::modules() const {
  std::lock_guard<std::mutex> l(mu_);
  return modules_;
}

CommModuleCounts CommDebugMode::comm_module_counts() const {
  CommModuleCounts out;
  for (const auto& r : records()) {
    const char* phase = r.backward ? "backward" : "forward";
    ++out["Global"][phase][r.type];
    std::vector<std::string> path = r.module_path;
    if (path.empty() && !r.module.empty()) path.push_back(r.module);
    std::sort(path.begin(), path.end());  // a module entered twice (recursion) counts once
    path.erase(std::unique(path.begin(), path.end()), path.end());
    for (const auto& fqn : path) ++out[fqn][phase][r.type];
  }
  return out;
}

std::string CommDebugMode::table() const {
  std::map<CommType, std::pair<int64_t, int64_t>> agg;  // count, bytes
  for (const auto& r : records()) {
    auto& a = agg[r.type];
    ++a.first;
    a.second += r.bytes;
  }
  std::ostringstream os;
  os << std::left << std::setw(42) << "collective" << std::right << std::setw(8) << "count"
     << std::setw(16) << "bytes"
     << "\n";
  os << std::string(66, '-') << "\n";
  int64_t n = 0, b = 0;
  for (const auto& [t, a] : agg) {
    os << std::left << std::setw(42) << comm_type_name(t) << std::right << std::setw(8) << a.first
       << std::setw(16) << a.second << "\n";
    n += a.first;
    b += a.second;
  }
  os << std::string(66, '-') << "\n"
     << std::left << std::setw(42) << "total" << std::right << std::setw(8) << n << std::setw(16)
     << b << "\n";
  return os.str();
}

std::string CommDebugMode::module_table() const {
  const CommModuleCounts counts = comm_module_counts();
  // Modules in the order they ran, then any seen only through collectives (backward-only).
  std::vector<std::string> names = modules();
  std::unordered_set<std::string> listed(names.begin(), names.end());
  for (const auto& r : records())
    for (const auto& fqn : r.module_path)
      if (listed.insert(fqn).second) names.push_back(fqn);

  // Tree by path: a module's parent is its longest listed ancestor.
  std::map<std::string, std::vector<std::string>> children;  // "" is Global
  for (const auto& fqn : names) {
    std::string parent;
    for (const auto& cand : names)
      if (is_ancestor(cand, fqn) && cand.size() > parent.size()) parent = cand;
    children[parent].push_back(fqn);
  }
  std::vector<std::pair<std::string, int>> rows{{"Global", 0}};
  std::function<void(const std::string&, int)> visit = [&](const std::string& p, int depth) {
    for (const auto& c : children[p]) {
      rows.emplace_back(c, depth);
      visit(c, depth + 1);
    }
  };
  visit("", 1);

  std::vector<CommType> types;
  for (const auto& [t, n] : get_comm_counts()) types.push_back(t);
  size_t name_w = 8;
  for (const auto& [name, depth] : rows) name_w = std::max(name_w, 2 * depth + name.size() + 2);
  std::vector<size_t> col_w;
  for (CommType t : types) col_w.push_back(std::max<size_t>(short_name(t).size(), 12) + 2);

  std::ostringstream os;
  os << std::left << std::setw(static_cast<int>(name_w)) << "module";
  for (size_t i = 0; i < types.size(); ++i)
    os << std::left << std::setw(static_cast<int>(col_w[i])) << short_name(types[i]);
  os << "\n" << std::setw(static_cast<int>(name_w)) << "";
  for (size_t i = 0; i < types.size(); ++i)
    os << std::left << std::setw(static_cast<int>(col_w[i])) << "  fwd   bwd";
  os << "\n";
  size_t width = name_w;
  for (size_t w : col_w) width += w;
  os << std::string(width, '-') << "\n";

  auto cell = [](const std::map<std::string, CommCounts>* m, const char* phase, CommType t) {
    if (m == nullptr) return std::string("-");
    auto p = m->find(phase);
    if (p == m->end()) return std::string("-");
    auto c = p->second.find(t);
    return c == p->second.end() ? std::string("-") : std::to_string(c->second);
  };
  for (const auto& [name, depth] : rows) {
    auto it = counts.find(name);
    const auto* m = it == counts.end() ? nullptr : &it->second;
    os << std::left << std::setw(static_cast<int>(name_w))
       << (std::string(2 * static_cast<size_t>(depth), ' ') + name);
    for (size_t i = 0; i < types.size(); ++i) {
      std::ostringstream c;
      c << std::right << std::setw(5) << cell(m, "forward", types[i]) << std::setw(6)
        << cell(m, "backward", types[i]);
      os << std::left << std::setw(static_cast<int>(col_w[i])) << c.str();
    }
    os << "\n";
  }
  return os.str();
}

std::string format_comm_counts(const CommCounts& counts) {
  std::string s;
  for (const auto& [t, n] : counts)
    s += (s.empty() ? "" : ", ") + std::string(comm_type_name(t)) + ": " + std::to_string(n);
  return "{" + s + "}";
}

ModuleScope::ModuleScope(const std::string& fqn) { tl_module_stack.push_back(fqn); }
ModuleScope::~ModuleScope() { tl_module_stack.pop_back(); }

bool ModuleScope::empty() { return tl_module_stack.empty(); }

std::vector<std::string> ModuleScope::current_path() {
  std::vector<std::string> path;
  // Forward code, including a forward recomputed inside backward.
  if (!tl_module_stack.empty()) {
    for (const auto& fqn : tl_module_stack)
      if (!fqn.empty()) path.push_back(fqn);
    return path;
  }
  const int task = torch::autograd::get_current_graph_task_id();
  if (task == -1) return path;
  std::lock_guard<std::mutex> g(backward_mutex());
  auto it = backward_stacks().find(task);
  if (it != backward_stacks().end()) path = it->second;
  return path;
}

std::string ModuleScope::current() {
  auto path = current_path();
  return path.empty() ? std::string() : path.back();
}

void ModuleScope::enter_backward(const std::string& fqn) {
  const int task = torch::autograd::get_current_graph_task_id();
  if (task == -1) return;
  bool new_task = false;
  {
    std::lock_guard<std::mutex> g(backward_mutex());
    auto [it, inserted] = backward_stacks().try_emplace(task);
    new_task = inserted;
    auto& stack = it->second;
    while (!stack.empty() && !is_ancestor(stack.back(), fqn) && !is_ancestor(fqn, stack.back()))
      stack.pop_back();
    // A child that returned the module's output tensor (wo for the attention) had its hook run
    // first on that shared tensor: it stays the innermost scope.
    auto first_child = std::find_if(stack.begin(), stack.end(),
                                    [&](const std::string& s) { return is_ancestor(fqn, s); });
    stack.insert(first_child, fqn);
  }
  // Forget the task's stack when its backward pass ends.
  if (new_task) {
    torch::autograd::Engine::get_default_engine().queue_callback([task] {
      std::lock_guard<std::mutex> g(backward_mutex());
      backward_stacks().erase(task);
    });
  }
}

void ModuleScope::exit_backward(const std::string& fqn) {
  const int task = torch::autograd::get_current_graph_task_id();
  if (task == -1) return;
  std::lock_guard<std::mutex> g(backward_mutex());
  auto it = backward_stacks().find(task);
  if (it == backward_stacks().end()) return;
  auto& stack = it->second;
  auto pos = std::find(stack.rbegin(), stack.rend(), fqn);
  if (pos != stack.rend()) stack.erase(std::prev(pos.base()), stack.end());
}

BackwardScope::BackwardScope() : prev_(tl_backward) { tl_backward = true; }
BackwardScope::~BackwardScope() { tl_backward = prev_; }
bool BackwardScope::active() {
  return tl_backward || torch::autograd::get_current_graph_task_id() != -1;
}

}  // namespace dtensor
