#include "dtensor/comm/process_group.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "backends.h"
#include "dtensor/comm/backend.h"
#include "dtensor/util/error_message.h"
#include "dtensor/comm/recording_backend.h"
#include "health.h"

namespace dtensor::comm {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, const std::string& value) {
  try {
    size_t pos = 0;
    int v = std::stoi(value, &pos);
    TORCH_CHECK(pos == value.size(), "");
    return v;
  } catch (...) {
    TORCH_CHECK(false, "dtensor: environment variable ", name, "='", value, "' is not an integer");
  }
}

bool is_loopback(const std::string& addr) {
  return addr.rfind("127.", 0) == 0 || addr == "localhost" || addr == "::1";
}

// The address this machine sends from to reach `host` (the kernel's route choice, found by
// connecting a UDP socket, which sends nothing), or "" when it has no route. On several
// machines Gloo must listen there: its default, the address of this machine's hostname, may be
// one the peers cannot reach (or none at all inside a network namespace).
std::string source_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0) return "";
  std::string result;
  for (addrinfo* a = found; a && result.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char text[NI_MAXHOST];
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof text, nullptr, 0,
                      NI_NUMERICHOST) == 0) {
      result = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return result;
}

struct WorldState {
  std::mutex mu;
  bool initialized = false;
  LaunchEnv env;
  InitOptions options;
  std::string backend;       // CPU engine: "gloo" or "mpi"
  std::string cuda_backend;  // CUDA engine: "nccl" or "gloo"
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<ProcessGroup> world;
  int64_t group_counter = 0;
  int64_t generation = 0;  // how many times this process joined (keys stay unique)
  std::string prefix;      // this join's store keys
  bool hosts_store = false;
  bool simulated = false;  // init_simulated_process_group: recording backends, no store
  // Stops the watchdog before exit tears down what it uses.
  ~WorldState() {
    if (!initialized || simulated) return;
    detail::health_stop(/*clean=*/false);
    leave_job();
  }
  // Counts this rank out of the job. The rank hosting the store then waits (a bounded time) for
  // every rank to have done so: a rank still running would otherwise find the store gone in
  // its watchdog, and TCPStore logs that with a stack trace.
  void leave_job() {
    if (!store || detail::health_poisoned()) return;
    try {
      const std::string key = prefix + "left";
      store->add(key, 1);
      const auto until = std::chrono::steady_clock::now() +
                         std::min<std::chrono::milliseconds>(options.timeout, kLeaveWait);
      while (hosts_store && store->add(key, 0) < env.world_size &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } catch (...) {
      // The store is gone already: nobody is left to wait for.
    }
  }
  static constexpr std::chrono::milliseconds kLeaveWait{10000};
};

using Clock = std::chrono::steady_clock;

double seconds(std::chrono::milliseconds t) { return t.count() / 1000.0; }

std::string where(const LaunchEnv& e) {
  return e.master_addr + ":" + std::to_string(e.master_port);
}

// True once something accepts TCP connections at addr:port. Polls until `deadline` so that a
// missing store fails on time (the store client's own retries overshoot the timeout).
bool wait_for_listener(const std::string& addr, int port, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  while (Clock::now() < deadline) {
    if (getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found) == 0) {
      for (addrinfo* a = found; a; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) continue;
        bool ok = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        if (!ok && errno == EINPROGRESS) {
          pollfd p{fd, POLLOUT, 0};
          if (::poll(&p, 1, 200) == 1) {
            int err = 0;
            socklen_t len = sizeof(err);
            ok = ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
          }
        }
        ::close(fd);
        if (ok) {
          freeaddrinfo(found);
          return true;
        }
      }
      freeaddrinfo(found);
      found = nullptr;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

std::string this_process() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return "pid " + std::to_string(::getpid()) + " on " + host;
}

// Tells every rank still waiting in the rendezvous why it failed: they read `msg` from the
// store. The rank hosting the store stays a moment so that they can, instead of taking the
// store down under them (they would see only a lost connection).
void announce_rendezvous_failure(c10d::Store& store, const std::string& prefix, const LaunchEnv& e,
                                 bool hosts_store, const std::string& msg) {
  try {
    detail::post_event(store, prefix, "fail\t" + std::to_string(e.rank) + "\t" + msg);
    const auto until = Clock::now() + std::chrono::seconds(1);
    while (hosts_store && Clock::now() < until &&
           store.add(prefix + "failure_seen", 0) + 1 < store.add(prefix + "registered", 0)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  } catch (...) {
    // Store gone: the peers fail on their own timeout.
  }
}

[[noreturn]] void fail_rendezvous(c10d::Store& store, const std::string& prefix, const LaunchEnv& e,
                                  bool hosts_store, const std::string& msg) {
  announce_rendezvous_failure(store, prefix, e, hosts_store, msg);
  TORCH_CHECK(false, "dtensor: rank ", e.rank, ": ", msg);
}

// Every rank registers (claiming its rank number and stating the world size), then waits
// until all have joined. Names duplicate ranks, disagreeing world sizes and missing ranks.
void rendezvous(c10d::Store& store, const LaunchEnv& e, const std::string& prefix,
                Clock::time_point deadline, std::chrono::milliseconds timeout, bool hosts_store) {
  const std::string me = this_process();
  const std::string r = std::to_string(e.rank);
  store.add(prefix + "registered", 1);
  const int64_t claim = store.add(prefix + "claims/" + r, 1);
  store.set(prefix + "claim/" + r + "/" + std::to_string(claim), me);
  if (claim > 1) {
    std::string first = "another process";
    try {
      const std::string key = prefix + "claim/" + r + "/1";
      store.wait({key}, std::chrono::seconds(1));
      auto v = store.get(key);
      first.assign(v.begin(), v.end());
    } catch (...) {
    }
    fail_rendezvous(store, prefix, e, hosts_store,
                    "rank " + r + " joined twice (" + first + " and " + me +
                        "): two processes were started with the same rank; check the "
                        "launcher's RANK assignment");
  }
  const std::string mine = std::to_string(e.world_size) + "\t" + r;
  auto stated = store.compareSet(prefix + "world_size", "", mine);
  const std::string theirs(stated.begin(), stated.end());
  if (theirs != mine) {
    const size_t tab = theirs.find('\t');
    const std::string size = theirs.substr(0, tab), who = theirs.substr(tab + 1);
    if (size != std::to_string(e.world_size)) {
      fail_rendezvous(store, prefix, e, hosts_store,
                      "WORLD_SIZE mismatch: rank " + who + " says " + size + ", rank " + r +
                          " says " + std::to_string(e.world_size) +
                          "; start every rank with the same WORLD_SIZE");
    }
  }
  int64_t n = store.add(prefix + "joined", 1);
  while (n < e.world_size) {
    const std::string failure = detail::peer_failure_in_store(store, prefix, e.rank);
    if (!failure.empty()) {
      store.add(prefix + "failure_seen", 1);
      TORCH_CHECK(false, "dtensor: rank ", e.rank, ": rendezvous at ", where(e),
                  " failed: ", failure);
    }
    if (Clock::now() >= deadline) {
      std::string missing;
      for (int q = 0; q < e.world_size; ++q) {
        if (!store.check({prefix + "claims/" + std::to_string(q)})) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(q);
        }
      }
      // Every rank has claimed its number: the late ones are a few store calls from joining
      // (a busy machine descheduled them there), and a failure on their side is announced.
      if (missing.empty() && Clock::now() < deadline + timeout) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        n = store.add(prefix + "joined", 0);
        continue;
      }
      if (missing.empty()) missing = "none (all claimed a rank but not all finished joining)";
      const std::string msg = c10::str(
          "dtensor: rank ", e.rank, " could not rendezvous with ", e.world_size, " ranks at ",
          where(e), " within ", seconds(timeout), " s: only ", n,
          " joined; missing rank(s): ", missing,
          " (never started, crashed before joining, or given another MASTER_ADDR/MASTER_PORT)");
      announce_rendezvous_failure(store, prefix, e, hosts_store, msg);
      TORCH_CHECK(false, msg);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    n = store.add(prefix + "joined", 0);
  }
}

// The CPU engine for `requested` ("", "auto", "gloo", "mpi", "nccl", any case), which came
// `from` DTENSOR_BACKEND or InitOptions::backend.
std::string resolve_cpu_backend(std::string requested, const char* from) {
  for (auto& c : requested) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (requested.empty() || requested == "auto") {
    // mpirun started the ranks: its shared-memory transport beats Gloo's loopback TCP.
    return env("OMPI_COMM_WORLD_RANK") && has_mpi() ? "mpi" : "gloo";
  }
  if (requested == "nccl") return "gloo";  // NCCL serves CUDA tensors; CPU ones stay on Gloo
  TORCH_CHECK(requested == "gloo" || requested == "mpi", "dtensor: unknown backend '", requested,
              "' in ", from, "; expected gloo, mpi, nccl or auto");
  TORCH_CHECK(requested == "gloo" || has_mpi(), "dtensor: ", from,
              " asks for the MPI backend but this build has none (no MPI library was found when "
              "CMake configured it): install libopenmpi-dev (scripts/setup does), re-run CMake and "
              "rebuild, or use gloo");
  return requested;
}

WorldState& state() {
  static WorldState s;
  return s;
}

}  // namespace

LaunchEnv read_launch_env() {
  LaunchEnv e;
  auto pick = [&](const char* rank, const char* size, const char* local, const char* source) {
    auto r = env(rank), s = env(size);
    if (!r || !s) return false;
    e.rank = env_int(rank, *r);
    e.world_size = env_int(size, *s);
    if (auto l = env(local)) e.local_rank = env_int(local, *l);
    e.source = source;
    return true;
  };
  if (!pick("RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun") &&
      !pick("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "ompi") &&
      !pick("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "slurm") &&
      !pick("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "pmi")) {
    e.source = "default";
  }
  if (auto a = env("MASTER_ADDR")) e.master_addr = *a;
  if (auto p = env("MASTER_PORT")) e.master_port = env_int("MASTER_PORT", *p);
  TORCH_CHECK(e.world_size >= 1, "dtensor: world size must be >= 1, got ", e.world_size);
  TORCH_CHECK(e.rank >= 0 && e.rank < e.world_size, "dtensor: rank ", e.rank,
              " is outside the world of ", e.world_size, " ranks (from ", e.source,
              " environment variables)");
  return e;
}

ProcessGroup::ProcessGroup(std::string name, std::vector<int> global_ranks, int rank,
                           c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds timeout,
                           std::string gloo_host, int mesh_dim)
    : name_(std::move(name)),
      global_ranks_(std::move(global_ranks)),
      rank_(rank),
      mesh_dim_(mesh_dim),
      store_(std::move(store)),
      timeout_(timeout),
      gloo_host_(std::move(gloo_host)) {}

ProcessGroup::~ProcessGroup() {
  if (detail::health_poisoned()) {
    // A collective was abandoned mid-flight; the backend's destructor would wait for it until
    // the timeout, so let the process exit without it.
    (void)cpu_.release();
    (void)cuda_.release();
  }
}

namespace {

// How long a group's first collective may take to connect its members: ranks reach it at their
// own pace, so the connect bound, not only the timeout that detects a failed peer.
std::chrono::milliseconds connect_bound(std::chrono::milliseconds timeout) {
  return std::max<std::chrono::milliseconds>(state().options.connect_timeout, timeout);
}

}  // namespace

void ProcessGroup::await_members(c10::DeviceType device_type) {
  const auto bound = connect_bound(timeout_);
  const auto deadline = Clock::now() + bound;
  const std::string base = std::string("arrived/") + c10::DeviceTypeName(device_type) + "/";
  store_->set(base + std::to_string(rank_), "1");
  const std::string count = base + "count";
  store_->add(count, 1);
  const std::string what = "connecting group " + name_ + " at its first collective";
  while (store_->add(count, 0) < size()) {
    detail::throw_if_peer_failed(what);
    if (Clock::now() >= deadline) {
      std::vector<int> silent;
      for (int q = 0; q < size(); ++q) {
        if (!store_->check({base + std::to_string(q)})) silent.push_back(global_rank(q));
      }
      TORCH_CHECK(false, "dtensor: rank ", global_rank(rank_), ": ", what, ": rank(s) ",
                  c10::Join(", ", silent), " did not arrive within ", seconds(bound),
                  " s (stalled, crashed, or issuing other collectives than this rank; "
                  "DTENSOR_CONNECT_TIMEOUT_S sets this bound)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

c10d::Backend& ProcessGroup::backend(c10::DeviceType device_type) {
  if (state().simulated) {  // one recording backend serves every device type
    if (!cpu_) cpu_ = c10::make_intrusive<RecordingBackend>(name_, rank_, size(), mesh_dim_);
    return *cpu_;
  }
  if (device_type == c10::DeviceType::CUDA) {
    if (!cuda_ && state().cuda_backend == "gloo") {
      cuda_ = detail::make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("gloo_cuda", store_),
                                        rank_, size(), connect_bound(timeout_),
                                        timeout_ - detail::diagnosis_budget(timeout_), gloo_host_);
    } else if (!cuda_) {
      TORCH_CHECK(detail::has_nccl(),
                  "dtensor: this build has no NCCL (LibTorch without CUDA, or nccl.h not found "
                  "at configure time), so CUDA tensors cannot be communicated");
      await_members(device_type);
      cuda_ =
          detail::make_nccl_backend(c10::make_intrusive<c10d::PrefixStore>("nccl", store_), rank_,
                                    size(), timeout_ - detail::diagnosis_budget(timeout_));
    }
    return *cuda_;
  }
  TORCH_CHECK(device_type == c10::DeviceType::CPU, "dtensor: no process group backend for ",
              c10::DeviceTypeName(device_type), " tensors (CPU uses Gloo or MPI, CUDA uses NCCL)");
  if (!cpu_ && state().backend == "mpi") {
    cpu_ = detail::make_mpi_backend(global_ranks_, rank_, name_);
  } else if (!cpu_) {
    await_members(device_type);
    cpu_ = detail::make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("gloo", store_), rank_,
                                     size(), connect_bound(timeout_),
                                     timeout_ - detail::diagnosis_budget(timeout_), gloo_host_);
  }
  return *cpu_;
}

void init_process_group(const InitOptions& options_in) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.initialized) return;
  InitOptions options = options_in;
  if (auto t = env("DTENSOR_TIMEOUT_S")) {
    options.timeout = std::chrono::seconds(env_int("DTENSOR_TIMEOUT_S", *t));
  }
  if (auto t = env("DTENSOR_CONNECT_TIMEOUT_S")) {
    options.connect_timeout = std::chrono::seconds(env_int("DTENSOR_CONNECT_TIMEOUT_S", *t));
  }
  const auto from_env = env("DTENSOR_BACKEND");
  const std::string engine = from_env
                                 ? resolve_cpu_backend(*from_env, "DTENSOR_BACKEND")
                                 : resolve_cpu_backend(options.backend, "InitOptions::backend");
  // CUDA tensors: NCCL, or Gloo (DTENSOR_CUDA_BACKEND=gloo), which also takes CUDA tensors
  // and, unlike NCCL, lets several ranks share one GPU (NCCL refuses two ranks on one device).
  std::string cuda_engine = env("DTENSOR_CUDA_BACKEND").value_or("nccl");
  for (auto& c : cuda_engine) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (cuda_engine.empty()) cuda_engine = "nccl";
  TORCH_CHECK(cuda_engine == "nccl" || cuda_engine == "gloo", "dtensor: unknown CUDA backend '",
              cuda_engine, "' in DTENSOR_CUDA_BACKEND; expected nccl or gloo");
  LaunchEnv e = read_launch_env();
  detail::health_prepare(e.rank);
  if (options.gloo_host.empty() && !env("GLOO_SOCKET_IFNAME")) {
    // Gloo listens where the rendezvous is reached from: loopback for one machine, the
    // interface of the route to MASTER_ADDR across machines.
    options.gloo_host =
        is_loopback(e.master_addr) ? "127.0.0.1" : source_address_towards(e.master_addr);
  }
  // Joining is connecting: ranks start at their own pace (a launcher on a busy machine), so it
  // has the connect bound, not only the timeout that detects a failed peer.
  const auto join_bound = std::max(options.timeout, options.connect_timeout);
  const auto deadline = Clock::now() + join_bound;
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(e.master_port);
  // torchrun (and our test harness) host the store in the launcher: then every rank is a client.
  const auto agent = env("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  so.isServer = e.rank == 0 && !agent_store;
  so.numWorkers = e.world_size;
  so.waitWorkers = false;   // rendezvous() below works whoever hosts the store
  so.timeout = join_bound;  // the store's own connect; options.timeout once joined
  if (!so.isServer && !wait_for_listener(e.master_addr, e.master_port, deadline)) {
    TORCH_CHECK(false, "dtensor: rank ", e.rank, ": no ", agent_store ? "launcher store" : "rank 0",
                " at ", where(e), " after ", seconds(join_bound),
                " s: nothing accepts connections there (it never started or crashed, or the "
                "ranks were given different MASTER_ADDR/MASTER_PORT)");
  }
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(e.master_addr, so);
  } catch (const std::exception& ex) {
    TORCH_CHECK(false, "dtensor: rank ", e.rank, " could not rendezvous with ", e.world_size,
                " ranks at ", where(e), " within ", seconds(join_bound),
                " s (a rank never started, crashed before joining, or the port is taken): ",
                util::error_message(ex));
  }
  const std::string prefix = "dtensor/g" + std::to_string(s.generation++) + "/";
  s.prefix = prefix;
  const auto lost_store = [&](const std::exception& ex) {
    TORCH_CHECK(false, "dtensor: rank ", e.rank, ": lost the store at ", where(e),
                " during rendezvous (", agent_store ? "the launcher" : "rank 0",
                " hosts it and probably exited): ", util::error_message(ex));
  };
  try {
    rendezvous(*store, e, prefix, deadline, join_bound, so.isServer);
  } catch (const c10::DistError& ex) {
    lost_store(ex);  // a c10::Error too, but the store's own: its host went away
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& ex) {
    lost_store(ex);
  }
  store->setTimeout(options.timeout);
  detail::health_start(store, prefix, e.rank, e.master_addr, store->getPort(), options.timeout,
                       e.world_size);
  s.env = e;
  s.options = options;
  s.backend = engine;
  s.cuda_backend = cuda_engine;
  s.store = store;
  s.hosts_store = so.isServer;
  s.simulated = false;
  std::vector<int> all(e.world_size);
  for (int i = 0; i < e.world_size; ++i) all[i] = i;
  s.world = std::make_shared<ProcessGroup>("world", all, e.rank,
                                           c10::make_intrusive<c10d::PrefixStore>("world", store),
                                           options.timeout, options.gloo_host);
  s.group_counter = 0;
  s.initialized = true;
}

bool is_initialized() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.initialized;
}

void destroy_process_group() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.initialized && !s.simulated) {
    detail::health_stop(/*clean=*/true);
    s.leave_job();
  }
  s.world.reset();
  s.store.reset();
  s.initialized = false;
  s.simulated = false;
}

void init_simulated_process_group(const SimulatedRank& sim) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  TORCH_CHECK(!s.initialized, "dtensor: init_simulated_process_group: this process is in a ",
              s.simulated ? "simulated world" : "job", " already; destroy_process_group() first");
  TORCH_CHECK(sim.world_size >= 1 && sim.rank >= 0 && sim.rank < sim.world_size,
              "dtensor: init_simulated_process_group: rank ", sim.rank, " is outside a world of ",
              sim.world_size, " ranks");
  LaunchEnv e;
  e.rank = sim.rank;
  e.world_size = sim.world_size;
  e.local_rank = sim.rank;
  e.source = "simulated";
  s.env = e;
  s.options = InitOptions{};
  s.backend = "recording";
  s.store.reset();
  s.hosts_store = false;
  s.simulated = true;
  std::vector<int> all(e.world_size);
  for (int i = 0; i < e.world_size; ++i) all[i] = i;
  s.world = std::make_shared<ProcessGroup>("world", all, e.rank, nullptr, s.options.timeout, "");
  s.group_counter = 0;
  s.initialized = true;
}

bool is_simulated() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.initialized && s.simulated;
}

static WorldState& initialized_state() {
  auto& s = state();
  TORCH_CHECK(s.initialized,
              "dtensor: the process group is not initialized; call "
              "dtensor::comm::init_process_group() first (or init_device_mesh(), which does)");
  return s;
}

int get_rank() { return initialized_state().env.rank; }
int get_world_size() { return initialized_state().env.world_size; }
int get_local_rank() { return initialized_state().env.local_rank; }
std::chrono::milliseconds default_timeout() { return initialized_state().options.timeout; }
std::shared_ptr<ProcessGroup> world_group() { return initialized_state().world; }

std::string cpu_backend_name() { return initialized_state().backend; }

bool detail::cpu_collectives_block() { return state().backend == "mpi"; }

std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& global_ranks, int mesh_dim) {
  auto& s = initialized_state();
  std::lock_guard<std::mutex> lock(s.mu);
  const int64_t id = s.group_counter++;
  int my = -1;
  for (size_t i = 0; i < global_ranks.size(); ++i) {
    TORCH_CHECK(global_ranks[i] >= 0 && global_ranks[i] < s.env.world_size, "dtensor: group rank ",
                global_ranks[i], " is outside the world of ", s.env.world_size, " ranks");
    TORCH_CHECK(i == 0 || global_ranks[i] > global_ranks[i - 1],
                "dtensor: group ranks must be sorted and unique");
    if (global_ranks[i] == s.env.rank) my = static_cast<int>(i);
  }
  if (my < 0) return nullptr;
  const std::string name = "group" + std::to_string(id) + "[" + c10::Join(",", global_ranks) + "]";
  return std::make_shared<ProcessGroup>(
      name, global_ranks, my,
      s.simulated ? nullptr : c10::make_intrusive<c10d::PrefixStore>(name, s.store),
      s.options.timeout, s.options.gloo_host, mesh_dim);
}

void barrier() {
  auto& s = initialized_state();
  if (s.simulated) return;  // the other ranks are simulated: nobody to wait for
  static int64_t generation = 0;
  const std::string key = "barrier/" + std::to_string(generation++);
  s.store->add(key, 1);
  const auto deadline = std::chrono::steady_clock::now() + s.options.timeout;
  while (s.store->add(key, 0) < s.env.world_size) {
    detail::throw_if_peer_failed("barrier");
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "dtensor: rank ", s.env.rank,
                " timed out in barrier after ", s.options.timeout.count() / 1000.0,
                " s: a peer never arrived");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace dtensor::comm
