#pragma once
// One rank of a run, simulated: a recording process group stands in for a world of
// config.world_size ranks (comm/recording_backend.h), the Trainer of dtensor_train is built on
// the meta device over the run's mesh (apply_tensor_parallel, apply_ac, fully_shard, the
// pipeline stage and schedule: the same calls as a real run), and one step is recorded.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/run_config.h"
#include "dtensor/comm/recording_backend.h"
#include "step_record.h"

namespace dtensor::plan {

// A rank of the run whose results stand for a class of ranks.
struct RankClass {
  int64_t rank = 0;                 // the global rank simulated
  std::vector<int64_t> coordinate;  // on the mesh
  std::string label;                // "stage 2 of 8" or "every rank"
};

// One representative rank per distinct class: every pipeline stage (its first dp and tp
// rank), or rank 0 without pipelining. Ranks of one stage differ only in which rows they hold;
// FSDP's last dp ranks may hold fewer rows of a parameter (torch.chunk's split) and are not
// simulated apart.
std::vector<RankClass> representative_ranks(const train::RunConfig& config);

struct RankResult {
  RankClass who;
  StepRecord step;
  std::vector<std::string> mesh_dims;                   // names of the mesh's dims
  std::map<std::string, std::vector<int>> group_ranks;  // by mesh dim name: global ranks
  std::vector<comm::RecordedOp> backend_calls;          // what the recording backend saw
};

// Simulates `who` of `config` (as resolve_run_config resolves it) on meta tensors. The
// process must not be in a process group; it is left in none.
RankResult simulate_rank(const train::RunConfig& config, const RankClass& who);

}  // namespace dtensor::plan
