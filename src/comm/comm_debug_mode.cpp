#include "dtensor/comm/comm_debug_mode.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

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

}  // namespace

const char* comm_type_name(CommType t) {
  switch (t) {
    case CommType::all_reduce: return "c10d_functional.all_reduce";
    case CommType::all_gather_into_tensor: return "c10d_functional.all_gather_into_tensor";
    case CommType::reduce_scatter_tensor: return "c10d_functional.reduce_scatter_tensor";
    case CommType::all_to_all_single: return "c10d_functional.all_to_all_single";
    case CommType::broadcast: return "c10d_functional.broadcast";
    case CommType::scatter: return "c10d.scatter_";
  }
  return "?";
}

std::ostream& operator<<(std::ostream& os, CommType t) { return os << comm_type_name(t); }

CommDebugMode::CommDebugMode() { enter(); }

CommDebugMode::~CommDebugMode() { exit(); }

void CommDebugMode::enter() {
  {
    std::lock_guard<std::mutex> l(mu_);
    records_.clear();
  }
  std::lock_guard<std::mutex> g(registry_mutex());
  if (!active_) {
    active_modes().push_back(this);
    active_ = true;
  }
}

void CommDebugMode::exit() {
  std::lock_guard<std::mutex> g(registry_mutex());
  if (active_) {
    auto& v = active_modes();
    v.erase(std::remove(v.begin(), v.end(), this), v.end());
    active_ = false;
  }
}

void CommDebugMode::record(const CommRecord& r) {
  std::lock_guard<std::mutex> g(registry_mutex());
  for (CommDebugMode* m : active_modes()) {
    std::lock_guard<std::mutex> l(m->mu_);
    m->records_.push_back(r);
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

std::map<std::string, std::map<std::string, CommCounts>> CommDebugMode::comm_module_counts() const {
  std::map<std::string, std::map<std::string, CommCounts>> out;
  for (const auto& r : records()) {
    const char* phase = r.backward ? "backward" : "forward";
    ++out["Global"][phase][r.type];
    // "A.b.c" counts for "A", "A.b" and "A.b.c".
    size_t pos = 0;
    while (!r.module.empty()) {
      pos = r.module.find('.', pos);
      ++out[r.module.substr(0, pos)][phase][r.type];
      if (pos == std::string::npos) break;
      ++pos;
    }
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
     << std::setw(16) << "bytes" << "\n";
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

std::string format_comm_counts(const CommCounts& counts) {
  std::string s = "{";
  bool first = true;
  for (const auto& [t, n] : counts) {
    if (!first) s += ", ";
    first = false;
    s += std::string(comm_type_name(t)) + ": " + std::to_string(n);
  }
  return s + "}";
}

ModuleScope::ModuleScope(const std::string& fqn) { tl_module_stack.push_back(fqn); }
ModuleScope::~ModuleScope() { tl_module_stack.pop_back(); }
std::string ModuleScope::current() {
  return tl_module_stack.empty() ? std::string() : tl_module_stack.back();
}

BackwardScope::BackwardScope() : prev_(tl_backward) { tl_backward = true; }
BackwardScope::~BackwardScope() { tl_backward = prev_; }
bool BackwardScope::active() { return tl_backward; }

}  // namespace dtensor
