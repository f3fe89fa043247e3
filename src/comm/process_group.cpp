#include "dtensor/comm/process_group.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "backends.h"

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

struct WorldState {
  std::mutex mu;
  bool initialized = false;
  LaunchEnv env;
  InitOptions options;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<ProcessGroup> world;
  int64_t group_counter = 0;
  int64_t generation = 0;  // how many times this process joined (keys stay unique)
};

// Every rank checks in; each waits until all have, or fails saying how many arrived.
void join_barrier(c10d::Store& store, const LaunchEnv& e, std::chrono::milliseconds timeout,
                  int64_t generation) {
  const std::string key = "dtensor/joined/" + std::to_string(generation);
  int64_t n = store.add(key, 1);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (n < e.world_size) {
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "dtensor: rank ", e.rank,
                " could not rendezvous with ", e.world_size, " ranks at ", e.master_addr, ":",
                e.master_port, " within ", timeout.count() / 1000.0, " s: only ", n,
                " joined (a rank never started, or crashed before joining)");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    n = store.add(key, 0);
  }
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

ProcessGroup::~ProcessGroup() = default;

c10d::Backend& ProcessGroup::backend(c10::DeviceType device_type) {
  if (device_type == c10::DeviceType::CUDA) {
    if (!cuda_) {
      TORCH_CHECK(detail::has_nccl(),
                  "dtensor: this build has no NCCL (LibTorch without CUDA, or nccl.h not found "
                  "at configure time), so CUDA tensors cannot be communicated");
      cuda_ = detail::make_nccl_backend(c10::make_intrusive<c10d::PrefixStore>("nccl", store_),
                                        rank_, size(), timeout_);
    }
    return *cuda_;
  }
  TORCH_CHECK(device_type == c10::DeviceType::CPU, "dtensor: no process group backend for ",
              c10::DeviceTypeName(device_type), " tensors (CPU uses Gloo, CUDA uses NCCL)");
  if (!cpu_) {
    cpu_ = detail::make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("gloo", store_), rank_,
                                     size(), timeout_, gloo_host_);
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
  LaunchEnv e = read_launch_env();
  if (options.gloo_host.empty() && !env("GLOO_SOCKET_IFNAME") && is_loopback(e.master_addr)) {
    options.gloo_host = "127.0.0.1";
  }
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(e.master_port);
  // torchrun (and our test harness) host the store in the launcher: then every rank is a client.
  const auto agent = env("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  so.isServer = e.rank == 0 && !agent_store;
  so.numWorkers = e.world_size;
  so.waitWorkers = false;  // join_barrier below works whoever hosts the store
  so.timeout = options.timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(e.master_addr, so);
  } catch (const std::exception& ex) {
    TORCH_CHECK(
        false, "dtensor: rank ", e.rank, " could not rendezvous with ", e.world_size, " ranks at ",
        e.master_addr, ":", e.master_port, " within ", options.timeout.count() / 1000.0,
        " s (a rank never started, crashed before joining, or the port is taken): ", ex.what());
  }
  join_barrier(*store, e, options.timeout, s.generation++);
  s.env = e;
  s.options = options;
  s.store = store;
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
  s.world.reset();
  s.store.reset();
  s.initialized = false;
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

std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& global_ranks, int mesh_dim) {
  auto& s = initialized_state();
  std::lock_guard<std::mutex> lock(s.mu);
  const int64_t id = s.group_counter++;
  for (size_t i = 0; i < global_ranks.size(); ++i) {
    TORCH_CHECK(global_ranks[i] >= 0 && global_ranks[i] < s.env.world_size, "dtensor: group rank ",
                global_ranks[i], " is outside the world of ", s.env.world_size, " ranks");
    TORCH_CHECK(i == 0 || global_ranks[i] > global_ranks[i - 1],
                "dtensor: group ranks must be sorted and unique");
  }
  int my = -1;
  for (size_t i = 0; i < global_ranks.size(); ++i) {
    if (global_ranks[i] == s.env.rank) my = static_cast<int>(i);
  }
  if (my < 0) return nullptr;
  std::string name = "group" + std::to_string(id) + "[";
  for (size_t i = 0; i < global_ranks.size(); ++i) {
    name += (i ? "," : "") + std::to_string(global_ranks[i]);
  }
  name += "]";
  return std::make_shared<ProcessGroup>(name, global_ranks, my,
                                        c10::make_intrusive<c10d::PrefixStore>(name, s.store),
                                        s.options.timeout, s.options.gloo_host, mesh_dim);
}

void barrier() {
  auto& s = initialized_state();
  static int64_t generation = 0;
  const std::string key = "barrier/" + std::to_string(generation++);
  s.store->add(key, 1);
  const auto deadline = std::chrono::steady_clock::now() + s.options.timeout;
  while (s.store->add(key, 0) < s.env.world_size) {
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "dtensor: rank ", s.env.rank,
                " timed out in barrier after ", s.options.timeout.count() / 1000.0,
                " s: a peer never arrived");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace dtensor::comm
