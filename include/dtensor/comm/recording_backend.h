#pragma once
// A c10d backend that stands in for one rank of a world of any size, for planning runs larger
// than this machine (apps/plan, docs/PLANNING.md). Selected by
// init_simulated_process_group(SimulatedRank{world_size, rank}) instead of init_process_group:
// no store, no peers, no network. Every collective and point-to-point message completes at once and
// leaves its tensors as they are: meta tensors (what a simulation runs on) have no values to
// change; a real tensor keeps this rank's own values (an all_reduce returns its input, a recv its
// buffer's contents). So only code whose collectives do not depend on values simulates faithfully:
// a step's forward, backward, gradient reductions and optimizer step do; reading a reduced loss or
// norm
// (.item()) does not.
//
// Each call is recorded: op, group and its size, mesh dim, dtype, bytes, module path and phase.
// Bytes follow CommDebugMode's convention: the bytes of this rank's input tensor (for recv and
// scatter, of the tensor it receives), so an all_gather of a 4 MiB shard over 8 ranks records
// 4 MiB. Groups of one rank never reach a backend (collectives.cpp completes them locally) and
// are not recorded here; CommDebugMode still counts them.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

namespace dtensor::comm {

/// The rank a simulated process plays.
struct SimulatedRank {
  int world_size = 1;  ///< Ranks in the simulated world.
  int rank = 0;        ///< This process's global rank in it.
};

/// Joins a simulated world as `who` instead of a job (init_process_group): no environment and
/// no store; every process group's backend is a RecordingBackend, for any device type (meta
/// included), and new_group creates only the groups `who` belongs to. destroy_process_group()
/// leaves it. Throws when `who.rank` is outside the world or a world is joined already.
void init_simulated_process_group(const SimulatedRank& who);
/// True while the world is a simulated one.
bool is_simulated();

/// One call a RecordingBackend completed.
struct RecordedOp {
  std::string op;     ///< "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                      ///< "all_to_all_single", "broadcast", "scatter", "send", "recv", "barrier".
  std::string group;  ///< The process group's name.
  int group_size = 0;
  int mesh_dim = -1;  ///< -1: not a mesh dimension's group.
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t bytes = 0;                     ///< This rank's input (received, for recv/scatter).
  std::vector<std::string> module_path;  ///< Tracked modules around the call, outermost first.
  std::string phase;                     ///< "forward", "backward", or what a RecordingPhase set.
};

/// Labels the calls recorded outside a backward pass on this thread with `phase` while alive
/// (nests); the default is "forward". A training step marks its optimizer part "optimizer".
class RecordingPhase {
 public:
  explicit RecordingPhase(std::string phase);
  ~RecordingPhase();
  RecordingPhase(const RecordingPhase&) = delete;
  RecordingPhase& operator=(const RecordingPhase&) = delete;
  static const std::string& current();  ///< "forward" outside any RecordingPhase.

 private:
  std::string previous_;
};

/// Every call the recording backends of this process completed since the last clear, in order.
std::vector<RecordedOp> recorded_ops();
/// Forgets the recorded calls.
void clear_recorded_ops();

/// The backend (one per process group and device type in a simulated world).
class RecordingBackend : public c10d::Backend {
 public:
  RecordingBackend(std::string group, int rank, int size, int mesh_dim);
  const std::string getBackendName() const override { return "recording"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

 private:
  // Records the call (`bytes` < 0: those of `t`) and returns a finished Work.
  c10::intrusive_ptr<c10d::Work> complete(const char* op, const at::Tensor& t, int64_t bytes = -1);
  std::string group_;
  int mesh_dim_;
};

}  // namespace dtensor::comm
