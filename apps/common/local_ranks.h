#pragma once
// Starting local ranks the way torchrun does, for dtrun, the benchmarks and the test harness:
// a free port on 127.0.0.1, a fork (and exec) per rank with RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and waiting for all of them. Plain POSIX:
// no LibTorch, so dtrun stays a small program.
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dtensor::launch {

using Env = std::vector<std::pair<std::string, std::string>>;

// A TCP port on 127.0.0.1 that nothing listens on right now (the kernel picks it). Throws
// std::system_error when no socket can be bound.
int free_port();

// The variables torchrun sets for rank `rank` of `world_size` ranks on this machine.
Env rank_env(int rank, int world_size, int port, const std::string& master_addr = "127.0.0.1");

// What a child gets besides its program: file descriptors >= 0 are dup2'ed onto its stdin,
// stdout and stderr; `env` is set (overwriting). Signal handlers and the signal mask are reset,
// so a child starts as a fresh process would.
struct ChildSetup {
  Env env;
  int stdin_fd = -1, stdout_fd = -1, stderr_fd = -1;
  bool own_process_group = false;  // setpgid(0, 0): signalled as a group with kill(-pid, sig)
  bool die_with_parent = false;    // Linux: SIGKILL when the parent dies (it cannot forward that)
  bool close_other_fds = false;    // close fds >= 3, so pipes to other children do not leak
};

// Forks; the child applies `setup` and exits with `body()`'s value (std::_Exit, after flushing
// stdio). Returns the child's pid; throws std::system_error when fork fails.
pid_t spawn_function(const std::function<int()>& body, const ChildSetup& setup = {});

struct Spawned {
  pid_t pid = -1;
  int exec_errno = 0;  // != 0: the program could not be executed (the child exits 127 or 126)
};

// Forks and execs argv (argv[0] searched in PATH). Returns once the exec succeeded or failed;
// the pid is valid either way and must be waited for. Throws std::system_error when fork fails.
Spawned spawn_program(const std::vector<std::string>& argv, const ChildSetup& setup = {});

// "exited with code 3", "was killed by signal 9 (Killed)".
std::string describe_status(int wait_status);
// Shell-style exit code of a wait status: the code, or 128 + signal.
int exit_code_of(int wait_status);

// Children waited for together. The destructor kills (SIGKILL) and reaps the ones still
// running, so none outlives its owner, also when it leaves through an exception.
class Children {
 public:
  Children() = default;
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;
  ~Children();

  void add(pid_t pid);
  const std::vector<pid_t>& pids() const { return pids_; }

  // Sends `sig` to every child not yet reaped.
  void signal_running(int sig);

  // From now until this object is destroyed, SIGINT, SIGTERM and SIGHUP sent to this process
  // are passed on to the children (a `timeout` or Ctrl-C would otherwise leave them running).
  void forward_termination_signals();

  struct Outcome {
    int status = -1;     // wait status; -1 while running
    double seconds = 0;  // from wait_all's start to its exit
    bool hung = false;   // still running at the deadline (then killed)
  };
  struct WaitOptions {
    std::chrono::milliseconds timeout{0};  // 0: no deadline
    // When a child fails (non-zero exit or signal): wait `grace`, then send `stop_signal` to
    // the others (they would only hang in their next collective). 0 for stop_signal: let them run.
    int stop_signal = 0;
    std::chrono::milliseconds grace{0};
    // Called once for the first child that fails, with its index and wait status.
    std::function<void(size_t index, int status)> on_failure;
  };
  // Waits for every child; returns their outcomes in the order they were added.
  std::vector<Outcome> wait_all(const WaitOptions& options);

 private:
  std::vector<pid_t> pids_;
  std::vector<bool> reaped_;
};

}  // namespace dtensor::launch
