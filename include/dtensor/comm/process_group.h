#pragma once
// Rendezvous and process groups. The only layer that talks to c10d.
//
// init_process_group() reads the launcher's environment (RANK/WORLD_SIZE/LOCAL_RANK/
// MASTER_ADDR/MASTER_PORT as torchrun and dtrun set them, or what Open MPI and Slurm set),
// meets the other ranks through a c10d TCPStore and builds the world group: Gloo for CPU
// tensors, NCCL for CUDA tensors (when LibTorch has CUDA).
#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace dtensor::comm {

/// Options of init_process_group.
struct InitOptions {
  /// Every collective fails after this long instead of hanging (and the rendezvous, if this is
  /// longer than `connect_timeout`). DTENSOR_TIMEOUT_S in the environment overrides the default.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  /// How long the rendezvous waits for every rank, and a group's first collective for every
  /// member (its backend connects then), if longer than `timeout`. Ranks arrive at their own
  /// pace (a launcher or a rank loading its part of a model on a busy machine), so this bound
  /// is separate from the timeout that detects a failed peer. DTENSOR_CONNECT_TIMEOUT_S in the
  /// environment overrides it.
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
  /// Address the Gloo transport binds to; empty = derived from the environment
  /// (GLOO_SOCKET_IFNAME's interface; else 127.0.0.1 for a loopback MASTER_ADDR, or the
  /// address this machine reaches MASTER_ADDR from; the host name's address without a route).
  std::string gloo_host;
  /// Engine for CPU tensors: "gloo", "mpi", "nccl" (NCCL for CUDA tensors, Gloo for CPU ones)
  /// or "auto"/empty (MPI when mpirun started the ranks and this build has it, else Gloo).
  /// DTENSOR_BACKEND in the environment overrides it, as DTENSOR_TIMEOUT_S does the timeout.
  std::string backend;
};

/// Where this process sits in the job, as read from the environment.
struct LaunchEnv {
  int rank = 0;                           ///< Global rank of this process.
  int world_size = 1;                     ///< Number of processes in the job.
  int local_rank = 0;                     ///< Rank of this process on its node.
  std::string master_addr = "127.0.0.1";  ///< Host of the rendezvous store (MASTER_ADDR).
  int master_port = 29500;                ///< Port of the rendezvous store (MASTER_PORT).
  std::string
      source;  // which launcher's variables were used: "torchrun", "ompi", "slurm", "default"
};
/// Reads RANK/WORLD_SIZE/... (or Open MPI/Slurm variables); defaults when none is set.
LaunchEnv read_launch_env();

/// A group of ranks with one c10d backend per device type. Mesh dimensions each own one.
class ProcessGroup {
 public:
  /// Builds a group of `global_ranks` where this process has group rank `rank`; backends are
  /// created lazily by backend(). Use new_group() rather than this constructor.
  ProcessGroup(std::string name, std::vector<int> global_ranks, int rank,
               c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds timeout,
               std::string gloo_host, int mesh_dim = -1);
  /// Releases the backends (abandoned without waiting when a collective failed mid-flight).
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  /// Unique name; prefixes the group's keys in the store.
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }  // rank inside this group
  /// Number of ranks in the group.
  int size() const { return static_cast<int>(global_ranks_.size()); }
  /// Global rank of each group rank.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  /// Global rank of group rank `group_rank` (throws when out of range).
  int global_rank(int group_rank) const { return global_ranks_.at(group_rank); }
  /// Mesh dimension this group serves (-1 for the world group); reported by CommDebugMode.
  int mesh_dim() const { return mesh_dim_; }
  void set_mesh_dim(int d) { mesh_dim_ = d; }  ///< Sets mesh_dim().
  /// Collective timeout of this group.
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// The rendezvous store the group's members share (its keys are not prefixed).
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  /// The c10d backend for tensors on `device_type`, created on first use (all members of the
  /// group reach it together because collectives are SPMD).
  c10d::Backend& backend(c10::DeviceType device_type);

 private:
  // Waits (up to the connect timeout) until every member has reached the group's first
  // collective for `device_type`; names the members that did not.
  void await_members(c10::DeviceType device_type);

  std::string name_;
  std::vector<int> global_ranks_;
  int rank_;
  int mesh_dim_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  std::string gloo_host_;
  c10::intrusive_ptr<c10d::Backend> cpu_;
  c10::intrusive_ptr<c10d::Backend> cuda_;
};

/// Joins the job. Throws with the rank and the address if the other ranks do not all arrive
/// within the timeout. Calling it again after success is a no-op.
void init_process_group(const InitOptions& options = {});
/// True after init_process_group succeeded (and before destroy_process_group).
bool is_initialized();
/// Drops the world and every group (a later init_process_group starts afresh).
void destroy_process_group();

/// This process's global rank. Like the getters below, throws before init_process_group.
int get_rank();
/// Number of ranks in the world.
int get_world_size();
/// This process's rank on its node (LOCAL_RANK).
int get_local_rank();
/// The collective timeout InitOptions (or DTENSOR_TIMEOUT_S) set.
std::chrono::milliseconds default_timeout();
/// The group of all ranks.
std::shared_ptr<ProcessGroup> world_group();

/// Group over `global_ranks` (sorted, unique). Only members get a group; others get nullptr.
/// Every rank must create groups in the same order: names are derived from a per-process
/// counter so that members of one group meet under the same store prefix.
std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& global_ranks, int mesh_dim = -1);

/// Blocks until every rank in the world reaches it (a store-based barrier: no device needed).
void barrier();

}  // namespace dtensor::comm
