#pragma once
// Small helpers the benchmarks share (header-only: each benchmark is one translation unit).
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>

namespace dtensor::bench {

// A reference script (e.g. bench/pytorch_tp_train_step.py) as given, or else beside the source
// tree of an in-tree build folder (build*/bench/bench_x -> bench/), so a benchmark runs from any
// directory.
inline std::string find_script(const std::string& script) {
  namespace fs = std::filesystem;
  if (fs::exists(script) || fs::path(script).is_absolute()) return script;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path candidate = exe.parent_path() / ".." / ".." / script;
    if (fs::exists(candidate)) return fs::weakly_canonical(candidate).string();
  }
  return script;
}

// What `command` (run by /bin/sh) printed on stdout, and its wait status; nullopt when it could
// not be started.
struct CommandOutput {
  std::string out;
  int status = -1;
};
inline std::optional<CommandOutput> run_command(const std::string& command) {
  std::fflush(stdout);
  FILE* p = ::popen(command.c_str(), "r");
  if (!p) return std::nullopt;
  CommandOutput r;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), p)) r.out += buf;
  r.status = ::pclose(p);
  return r;
}

}  // namespace dtensor::bench
