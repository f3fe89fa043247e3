#include "simulate.h"

#include <ATen/ATen.h>

#include <optional>

#include "dtensor/comm/process_group.h"
#include "dtensor/comm/recording_backend.h"
#include "dtensor/dispatch/cache.h"
#include "dtensor/mesh/device_mesh.h"
#include "meta_kernels.h"

namespace dtensor::plan {

std::vector<RankClass> representative_ranks(const train::RunConfig& c) {
  std::vector<RankClass> out;
  if (c.pp <= 1) {
    out.push_back({0, {}, "every rank"});
    return out;
  }
  const int64_t per_stage = c.world_size / c.pp;  // mesh [pp, tp]: stage s starts at s * tp
  for (int64_t s = 0; s < c.pp; ++s) {
    out.push_back(
        {s * per_stage, {}, "stage " + std::to_string(s) + " of " + std::to_string(c.pp)});
  }
  return out;
}

RankResult simulate_rank(const train::RunConfig& config, const RankClass& who) {
  use_meta_kernels();
  train::RunConfig cfg = config;
  cfg.meta = true;
  comm::init_simulated_process_group(
      {static_cast<int>(cfg.world_size), static_cast<int>(who.rank)});
  // Nothing of this world outlives it: the thread's sharding decisions hold its meshes (and
  // their groups) and tensors the next simulation's allocator accounting would otherwise see.
  struct Leave {
    ~Leave() {
      dispatch::clear_cache();
      comm::destroy_process_group();
      comm::clear_recorded_ops();
    }
  } leave;

  RankResult out;
  out.who = who;
  CountingAllocator& memory = CountingAllocator::of(c10::DeviceType::Meta);
  memory.set_origin();
  {
    const DeviceMesh mesh = train::make_train_mesh(cfg, "meta");
    out.who.coordinate = *mesh.coordinate();
    out.mesh_dims = mesh.dim_names();
    for (int64_t d = 0; d < mesh.ndim(); ++d)
      out.group_ranks[mesh.dim_names()[d]] = mesh.group(d).global_ranks();
    std::optional<train::Trainer> trainer;
    trainer.emplace(cfg, mesh);
    // Token ids stay on the CPU (uninitialised: no lookup reads them): a plain meta tensor
    // meeting a DTensor would dispatch to its Meta kernel, which outranks DTensor's key.
    const auto tokens = at::TensorOptions().dtype(at::kLong);
    const train::Batch batch{at::empty({cfg.batch_size, cfg.seq_len}, tokens),
                             at::empty({cfg.batch_size, cfg.seq_len}, tokens)};
    // A first step, unrecorded: AdamW creates its moments, FSDP learns the order of its units
    // (it prefetches from the second step on), so the recorded step is a steady-state one.
    record_step(*trainer, batch, memory);
    comm::clear_recorded_ops();
    out.step = record_step(*trainer, batch, memory);
    out.backend_calls = comm::recorded_ops();
  }
  return out;
}

}  // namespace dtensor::plan
