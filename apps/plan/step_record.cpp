#include "step_record.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "dtensor/comm/recording_backend.h"
#include "flop_counter.h"

namespace dtensor::plan {

StepRecord record_step(train::Trainer& trainer, const train::Batch& batch,
                       CountingAllocator& memory) {
  StepRecord out;
  CommDebugMode comm;
  out.start_bytes = memory.live();
  memory.reset_peak();
  {
    FlopCounter counter;
    at::Tensor loss = trainer.forward_backward(batch);
    out.flops = counter.flops();
  }
  out.fb_peak_bytes = memory.peak();
  const size_t backward_end = comm.records().size();
  memory.reset_peak();
  {
    comm::RecordingPhase phase("optimizer");
    trainer.optimizer().step();
  }
  out.opt_peak_bytes = memory.peak();
  comm.exit();
  const auto records = comm.records();
  for (size_t i = 0; i < records.size(); ++i) {
    const char* phase = i >= backward_end     ? "optimizer"
                        : records[i].backward ? "backward"
                                              : "forward";
    out.collectives.push_back({records[i], phase});
  }
  out.state = trainer.state_bytes();
  return out;
}

std::vector<std::string> not_simulated(const train::RunConfig& c) {
  std::vector<std::string> out;
  const std::string clip =
      "gradient-norm clipping (nn::utils::clip_grad_norm_) reads the global norm";
  if (c.pp > 1) {
    out.push_back(clip +
                  (c.tp > 1 ? ": the DTensor-aware norm's all_reduce(s) over tp, then " : ": ") +
                  "1 all_reduce of 1 float64 over pp");
    out.push_back(
        "loss and bubble to every rank (PipelinePart::step_values): 1 all_reduce of 2 float64 "
        "over pp");
  } else if (c.fsdp) {
    out.push_back(clip + ": 1 all_reduce of 2 float64 over dp" +
                  (c.tp > 1 ? std::string(", 1 of 1 float64 over tp") : std::string()));
    out.push_back("loss averaged over dp (Trainer::mean_over_dp): 1 all_reduce of 1 float64");
  } else {
    if (c.world_size > 1)
      out.push_back(clip +
                    ": clip_grad_norm_ on DTensor gradients (all_reduce of the sharded "
                    "gradients' norms over tp)");
    if (c.dp > 1)
      out.push_back("loss averaged over dp (Trainer::mean_over_dp): 1 all_reduce of 1 float64");
  }
  if (c.model.has_moe() && c.dp > 1)
    out.push_back(
        "the routing statistics of the log (Trainer::train_step): 1 all_reduce of 1 float64 (the "
        "auxiliary loss) and 1 of " +
        std::to_string(c.model.moe->options.num_experts) + " float64 (tokens per expert) over dp");
  out.push_back(
      "the first step's one-time messages: the pipeline's activation shapes, the TP "
      "plan's cross-rank check (one all_gather at parallelize time)");
  out.push_back("NaN/inf checks and anything else that reads a tensor's value (.item())");
  return out;
}

}  // namespace dtensor::plan
