#include "local_ranks.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <thread>

namespace dtensor::launch {
namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// In the child, between fork and exec (or the body): only what fork leaves safe to call.
void apply(const ChildSetup& s, pid_t parent) {
  if (s.own_process_group) ::setpgid(0, 0);
#ifdef __linux__
  if (s.die_with_parent) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);  // the parent died before prctl took effect
  }
#else
  (void)parent;
#endif
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) ::signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  if (s.stdin_fd >= 0) ::dup2(s.stdin_fd, STDIN_FILENO);
  if (s.stdout_fd >= 0) ::dup2(s.stdout_fd, STDOUT_FILENO);
  if (s.stderr_fd >= 0) ::dup2(s.stderr_fd, STDERR_FILENO);
  if (s.close_other_fds) {
    for (int fd = 3; fd < 1024; ++fd) ::close(fd);
  }
  for (const auto& [name, value] : s.env) ::setenv(name.c_str(), value.c_str(), 1);
}

pid_t checked_fork() {
  std::fflush(nullptr);  // or the child repeats what the parent had buffered
  const pid_t pid = ::fork();
  if (pid < 0) throw_errno("fork failed");
  return pid;
}

}  // namespace

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw_errno("could not open a socket to find a free port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    throw_errno("could not find a free port on 127.0.0.1");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

Env rank_env(int rank, int world_size, int port, const std::string& master_addr) {
  const std::string r = std::to_string(rank), n = std::to_string(world_size);
  return {{"RANK", r},
          {"LOCAL_RANK", r},
          {"WORLD_SIZE", n},
          {"LOCAL_WORLD_SIZE", n},
          {"MASTER_ADDR", master_addr},
          {"MASTER_PORT", std::to_string(port)}};
}

pid_t spawn_function(const std::function<int()>& body, const ChildSetup& setup) {
  const pid_t parent = ::getpid();
  const pid_t pid = checked_fork();
  if (pid == 0) {
    apply(setup, parent);
    int code = 1;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "uncaught exception in a child process: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "uncaught exception in a child process\n");
    }
    std::fflush(nullptr);
    std::_Exit(code);
  }
  if (setup.own_process_group) ::setpgid(pid, pid);
  return pid;
}

Spawned spawn_program(const std::vector<std::string>& argv, const ChildSetup& setup) {
  // The child writes errno here when exec fails; a successful exec closes it (O_CLOEXEC).
  int status_pipe[2];
  if (::pipe2(status_pipe, O_CLOEXEC) != 0) throw_errno("pipe failed");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_t pid = -1;
  try {
    pid = checked_fork();
  } catch (...) {
    ::close(status_pipe[0]);
    ::close(status_pipe[1]);
    throw;
  }
  if (pid == 0) {
    ChildSetup s = setup;
    s.close_other_fds = false;  // done below, sparing the status pipe
    apply(s, parent);
    if (setup.close_other_fds) {
      for (int fd = 3; fd < 1024; ++fd) {
        if (fd != status_pipe[1]) ::close(fd);
      }
    }
    ::execvp(args[0], args.data());
    const int e = errno;
    [[maybe_unused]] ssize_t n = ::write(status_pipe[1], &e, sizeof e);
    ::_exit(e == ENOENT ? 127 : 126);
  }
  // Also here, so the group exists before the parent may signal it.
  if (setup.own_process_group) ::setpgid(pid, pid);
  ::close(status_pipe[1]);
  Spawned out;
  out.pid = pid;
  ssize_t n;
  do n = ::read(status_pipe[0], &out.exec_errno, sizeof out.exec_errno);
  while (n < 0 && errno == EINTR);
  ::close(status_pipe[0]);
  if (n != static_cast<ssize_t>(sizeof out.exec_errno)) out.exec_errno = 0;
  return out;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = ::strsignal(sig);
    return "was killed by signal " + std::to_string(sig) +
           (name ? std::string(" (") + name + ")" : "");
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

int exit_code_of(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

namespace {
Children* g_forwarding = nullptr;
extern "C" void forward_to_children(int sig) {
  if (g_forwarding != nullptr) g_forwarding->signal_running(sig);
}
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};
}  // namespace

void Children::forward_termination_signals() {
  g_forwarding = this;
  struct sigaction sa {};
  sa.sa_handler = forward_to_children;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : kForwarded) ::sigaction(sig, &sa, nullptr);
}

Children::~Children() {
  if (g_forwarding == this) {
    for (int sig : kForwarded) ::signal(sig, SIG_DFL);
    g_forwarding = nullptr;
  }
  signal_running(SIGKILL);
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (!reaped_[i]) ::waitpid(pids_[i], nullptr, 0);
  }
}

void Children::add(pid_t pid) {
  pids_.push_back(pid);
  reaped_.push_back(false);
}

void Children::signal_running(int sig) {
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (!reaped_[i]) ::kill(pids_[i], sig);
  }
}

std::vector<Children::Outcome> Children::wait_all(const WaitOptions& o) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  std::vector<Outcome> out(pids_.size());
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (reaped_[i]) out[i].status = 0;  // waited for earlier
  }
  bool failure_seen = false;
  auto stop_at = Clock::time_point::max();  // when to stop the others after a failure
  while (std::ranges::find(reaped_, false) != reaped_.end()) {  // some child is still running
    bool progress = false;
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (reaped_[i]) continue;
      int st = 0;
      if (::waitpid(pids_[i], &st, WNOHANG) != pids_[i]) continue;
      reaped_[i] = true;
      progress = true;
      out[i].status = st;
      out[i].seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      const bool failed = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
      if (failed && !failure_seen) {
        failure_seen = true;
        if (o.on_failure) o.on_failure(i, st);
        if (o.stop_signal != 0) stop_at = Clock::now() + o.grace;
      }
    }
    const auto now = Clock::now();
    if (now >= stop_at) {
      signal_running(o.stop_signal);
      stop_at = Clock::time_point::max();
    }
    if (o.timeout.count() > 0 && now - t0 > o.timeout) {
      for (size_t i = 0; i < pids_.size(); ++i) out[i].hung = !reaped_[i];
      signal_running(SIGKILL);
      for (size_t i = 0; i < pids_.size(); ++i) {
        if (reaped_[i]) continue;
        ::waitpid(pids_[i], &out[i].status, 0);
        reaped_[i] = true;
      }
      break;
    }
    if (!progress) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return out;
}

}  // namespace dtensor::launch
