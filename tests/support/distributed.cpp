#include "support/distributed.h"

#include <ATen/Parallel.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "common/local_ranks.h"
#include "dtensor/comm/failure.h"
#include "dtensor/comm/process_group.h"
#include "support/mpi_job.h"
#include "support/rank_outcomes.h"

namespace dtensor::testing {
namespace {

namespace launch = dtensor::launch;

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

std::string read_all(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

// One rank, in its forked process (launch::rank_env is set): runs `body`, returns the exit code.
int child(int rank, int err_fd, const std::function<void(int)>& body, const RunOptions& o) {
  int code = 0;
  std::string msg;
  try {
    at::set_num_threads(1);
    at::manual_seed(0);  // every rank starts from the same seed, as single-device references need
    const bool trace = std::getenv("DTENSOR_TEST_TRACE") != nullptr;
    auto t0 = std::chrono::steady_clock::now();
    auto since = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    if (o.init_process_group) dtensor::comm::init_process_group();
    if (trace) std::fprintf(stderr, "[trace] rank %d joined after %.3f s\n", rank, since());
    body(rank);
    if (trace) std::fprintf(stderr, "[trace] rank %d finished after %.3f s\n", rank, since());
    if (::testing::Test::HasFailure()) {
      code = 1;
      msg = "rank " + std::to_string(rank) + ": assertion failures (see output above)";
    }
  } catch (const c10::Error& e) {
    code = 2;
    msg = "rank " + std::to_string(rank) + " threw: " + e.what_without_backtrace();
  } catch (const std::exception& e) {
    code = 2;
    msg = "rank " + std::to_string(rank) + " threw: " + e.what();
  }
  if (code == 2) dtensor::comm::report_failure(msg);  // the other ranks stop too, naming it
  if (!msg.empty()) write_all(err_fd, msg + "\n");
  return code;
}

// Forks the store agent and the ranks, waits for them (stopping the rest soon after one fails
// when `stop_on_failure`) and returns how each ended.
std::vector<RankOutcome> fork_ranks(int world_size, const std::function<void(int)>& body,
                                    const RunOptions& options, bool stop_on_failure) {
  std::vector<RankOutcome> out(world_size);
  // Like torchrun's agent, a separate process hosts the store, so it listens before any rank
  // starts and the ranks inherit no listening socket.
  int port_pipe[2];
  if (::pipe(port_pipe) != 0) {
    ADD_FAILURE() << "pipe failed";
    return out;
  }
  launch::Children agent;  // killed and reaped when this function returns
  agent.add(launch::spawn_function([&]() -> int {
    ::close(port_pipe[0]);
    c10d::TCPStoreOptions so;
    so.port = 0;
    so.isServer = true;
    so.waitWorkers = false;
    so.timeout = options.comm_timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    const int p = store->getPort();
    write_all(port_pipe[1], std::to_string(p) + "\n");
    ::close(port_pipe[1]);
    for (;;) ::pause();  // killed by the parent when the ranks are done
  }));
  ::close(port_pipe[1]);
  const int port = std::stoi(read_all(port_pipe[0]));
  ::close(port_pipe[0]);
  std::vector<int> err_fds;
  launch::Children ranks;
  for (int r = 0; r < world_size; ++r) {
    int p[2];
    if (::pipe(p) != 0) ADD_FAILURE() << "pipe failed";
    launch::ChildSetup setup;
    setup.env = launch::rank_env(r, world_size, port);
    setup.env.emplace_back("DTENSOR_TIMEOUT_S", std::to_string(options.comm_timeout.count()));
    if (options.connect_timeout) {
      setup.env.emplace_back("DTENSOR_CONNECT_TIMEOUT_S",
                             std::to_string(options.connect_timeout->count()));
    }
    setup.env.emplace_back("TORCHELASTIC_USE_AGENT_STORE", "True");
    ranks.add(launch::spawn_function(
        [&, r, fd = p[1]] {
          ::close(p[0]);
          return child(r, fd, body, options);
        },
        setup));
    ::close(p[1]);
    err_fds.push_back(p[0]);
  }
  launch::Children::WaitOptions wait;
  wait.timeout = options.timeout;
  if (stop_on_failure) {
    // One rank failed: give the others a moment to fail on their own, then stop them.
    wait.stop_signal = SIGKILL;
    wait.grace = std::chrono::milliseconds(200);
  }
  const auto ended = ranks.wait_all(wait);
  for (int r = 0; r < world_size; ++r) {
    out[r].status = ended[r].status;
    out[r].seconds = ended[r].seconds;
    out[r].hung = ended[r].hung;
  }
  for (int r = 0; r < world_size; ++r) {
    out[r].message = read_all(err_fds[r]);
    ::close(err_fds[r]);
  }
  return out;
}

std::optional<int> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::atoi(v);
}

// The first port the kernel hands out to outgoing connections (Linux's default is 32768).
int first_ephemeral_port() {
  int low = 32768, high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &low, &high) != 2) low = 32768;
    std::fclose(f);
  }
  return low;
}

// The port of the job's store: the same on every rank, different for concurrent jobs. Taken
// below the ephemeral range: there any connection's local port could already hold it
// (EADDRINUSE in CI, between two mpirun entries).
int mpi_job_port() {
  if (auto p = env_int("DTENSOR_TEST_PORT_BASE")) return *p;
  const char* job = std::getenv("OMPI_MCA_ess_base_jobid");
  const int base = 10000, span = std::max(1000, first_ephemeral_port() - base);
  return base + static_cast<int>(std::hash<std::string>{}(job ? job : "") % span);
}

// Runs `body` as this process's rank of the mpirun job.
void run_in_mpi_job(int rank, const std::function<void(int)>& body, const RunOptions& o) {
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("LOCAL_RANK");
  // Like the forked harness's agent, one store outlives every test: were rank 0 to host a
  // store per test, it could close it while a slower rank still polls it. Rank 0 keeps it open
  // at exit until every rank has finished its last test.
  struct JobStore {
    c10::intrusive_ptr<c10d::TCPStore> store;
    bool host = false;
    int64_t expected = 0;  // runs finished by all ranks, as counted at the end of each run
    ~JobStore() {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      try {
        while (host && store->add("harness/finished", 0) < expected &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      } catch (...) {
      }
    }
  };
  static JobStore job;
  static const int port = mpi_job_port();
  if (!job.store) {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = rank == 0;
    so.waitWorkers = false;
    so.timeout = o.comm_timeout;
    job.host = rank == 0;
    job.store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  }
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("DTENSOR_TIMEOUT_S", std::to_string(o.comm_timeout.count()).c_str(), 1);
  if (o.connect_timeout) {
    ::setenv("DTENSOR_CONNECT_TIMEOUT_S", std::to_string(o.connect_timeout->count()).c_str(), 1);
  }
  at::set_num_threads(1);
  at::manual_seed(0);
  try {
    if (o.init_process_group) dtensor::comm::init_process_group();
    body(rank);
  } catch (const c10::Error& e) {
    const std::string msg =
        "rank " + std::to_string(rank) + " threw: " + e.what_without_backtrace();
    dtensor::comm::report_failure(msg);  // the other ranks stop too, naming it
    ADD_FAILURE() << "distributed test failed:\n" << msg;
  } catch (const std::exception& e) {
    const std::string msg = "rank " + std::to_string(rank) + " threw: " + e.what();
    dtensor::comm::report_failure(msg);
    ADD_FAILURE() << "distributed test failed:\n" << msg;
  }
  dtensor::comm::destroy_process_group();
  job.expected += *env_int("OMPI_COMM_WORLD_SIZE");
  job.store->add("harness/finished", 1);
}

}  // namespace

bool in_mpi_job() { return env_int("OMPI_COMM_WORLD_SIZE").has_value(); }

std::vector<int> world_sizes_to_run(const std::vector<int>& sizes) {
  if (!in_mpi_job()) return sizes;
  const int job = *env_int("OMPI_COMM_WORLD_SIZE");
  std::vector<int> out;
  for (int n : sizes)
    if (n == job) out.push_back(n);
  return out;
}

std::vector<RankOutcome> run_ranks_collect(int world_size, const std::function<void(int)>& body,
                                           const RunOptions& options) {
  if (in_mpi_job()) {
    ADD_FAILURE() << "run_ranks_collect forks ranks and cannot run inside an mpirun job; start "
                     "the test with SKIP_IN_MPI_JOB()";
    return std::vector<RankOutcome>(world_size);
  }
  return fork_ranks(world_size, body, options, /*stop_on_failure=*/false);
}

void run_ranks(int world_size, const std::function<void(int)>& body, const RunOptions& options) {
  if (in_mpi_job()) {
    const int job = *env_int("OMPI_COMM_WORLD_SIZE");
    if (job != world_size) {
      GTEST_SKIP() << "needs " << world_size << " ranks; this mpirun job has " << job;
    }
    run_in_mpi_job(*env_int("OMPI_COMM_WORLD_RANK"), body, options);
    return;
  }
  const auto out = fork_ranks(world_size, body, options, /*stop_on_failure=*/true);
  std::ostringstream failures;
  int hung = 0;
  for (int r = 0; r < world_size; ++r) {
    const int st = out[r].status;
    hung += out[r].hung ? 1 : 0;
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
    if (!out[r].message.empty()) {
      failures << out[r].message;
    } else if (WIFSIGNALED(st)) {
      failures << "rank " << r << " was killed by signal " << WTERMSIG(st)
               << (WTERMSIG(st) == SIGKILL ? " (stopped after another rank failed)" : "") << "\n";
    } else {
      failures << "rank " << r << " exited with code " << WEXITSTATUS(st) << "\n";
    }
  }
  if (hung > 0) {
    ADD_FAILURE() << "distributed test timed out after " << options.timeout.count() << " s with "
                  << hung << " rank(s) still running";
  }
  const std::string f = failures.str();
  if (!f.empty()) ADD_FAILURE() << "distributed test failed:\n" << f;
}

::testing::AssertionResult tensors_close(const at::Tensor& actual, const at::Tensor& expected,
                                         double rtol, double atol) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " != expected " << expected.sizes();
  }
  if (actual.numel() == 0) return ::testing::AssertionSuccess();
  // Complex values compare as real pairs (a cast to double would drop the imaginary parts).
  const bool complex = actual.is_complex() || expected.is_complex();
  auto as_compared = [complex](const at::Tensor& t) {
    at::Tensor d = t.detach().cpu();
    return complex ? at::view_as_real(d.to(at::kComplexDouble)) : d.to(at::kDouble);
  };
  auto a = as_compared(actual);
  auto e = as_compared(expected);
  if (at::allclose(a, e, rtol, atol)) return ::testing::AssertionSuccess();
  auto diff = (a - e).abs();
  return ::testing::AssertionFailure()
         << "tensors differ: max abs diff " << diff.max().item<double>() << " (rtol " << rtol
         << ", atol " << atol << ")\nactual:\n"
         << a << "\nexpected:\n"
         << e;
}

std::string describe_outcomes(const std::vector<RankOutcome>& out) {
  std::ostringstream o;
  for (size_t r = 0; r < out.size(); ++r) {
    o << "rank " << r << ": ";
    if (out[r].hung) {
      o << "HUNG";
    } else if (WIFSIGNALED(out[r].status)) {
      o << "signal " << WTERMSIG(out[r].status);
    } else {
      o << "exit " << WEXITSTATUS(out[r].status);
    }
    o << " after " << out[r].seconds << " s: " << out[r].message << "\n";
  }
  return o.str();
}

}  // namespace dtensor::testing
