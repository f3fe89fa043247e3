#pragma once
// Small helpers the benchmarks share (header-only: each benchmark is one translation unit).
#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "common/local_ranks.h"

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

// Runs this program again as ranks 0..world-1 on 127.0.0.1 (RANK, WORLD_SIZE, MASTER_ADDR, ...
// set, and `rank0_env` on rank 0 only), with the same arguments, and waits for them. Only rank
// 0's stdout is shown; every rank's stderr is. Returns the exit code of the first rank that
// fails (the others, which would only hang in their next collective, are then stopped), or 0.
inline int run_local_ranks(const std::string& name, int argc, char** argv, int world,
                           const launch::Env& rank0_env = {}) {
  launch::Children ranks;
  try {
    const int port = launch::free_port();
    for (int r = 0; r < world; ++r) {
      launch::ChildSetup setup;
      setup.env = launch::rank_env(r, world, port);
      if (r == 0) setup.env.insert(setup.env.end(), rank0_env.begin(), rank0_env.end());
      const int devnull = r == 0 ? -1 : ::open("/dev/null", O_WRONLY | O_CLOEXEC);
      setup.stdout_fd = devnull;
      std::vector<std::string> args = {"/proc/self/exe"};
      args.insert(args.end(), argv + 1, argv + argc);
      const auto spawned = launch::spawn_program(args, setup);
      if (devnull >= 0) ::close(devnull);
      ranks.add(spawned.pid);
      if (spawned.exec_errno != 0) {
        std::cerr << name << ": rank " << r
                  << ": exec failed: " << std::strerror(spawned.exec_errno) << "\n";
        return 1;
      }
    }
  } catch (const std::system_error& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 1;
  }
  ranks.forward_termination_signals();
  int status = 0;
  launch::Children::WaitOptions wait;
  wait.stop_signal = SIGTERM;
  wait.on_failure = [&](size_t rank, int wait_status) {
    status = launch::exit_code_of(wait_status);
    std::cerr << name << ": rank " << rank << " exited with status " << status
              << "; stopping the other ranks\n";
  };
  ranks.wait_all(wait);
  return status;
}

}  // namespace dtensor::bench
