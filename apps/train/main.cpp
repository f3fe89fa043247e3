// dtensor_train: tensor-parallel training of a bundled preset model, or fine-tuning of a
// Hugging Face checkpoint (--hf), on the ranks of a launch (dtrun, torchrun --no-python, srun,
// mpirun), or alone as one rank. See --help.
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "common/options.h"
#include "dtensor/util/error_message.h"
#include "dtensor/comm/failure.h"
#include "dtensor/comm/process_group.h"
#include "train_run.h"

namespace {

// Usage and configuration errors (exit 2) are found by every rank alike and explained by rank 0
// alone. The other ranks leave a moment later, so that a launcher that stops all ranks when one
// fails (dtrun, torchrun) does not stop rank 0 before it has said why.
int finish(int code, const dtensor::comm::LaunchEnv& env) {
  if (code == 2 && env.rank != 0) std::this_thread::sleep_for(std::chrono::seconds(2));
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  const auto env = dtensor::comm::read_launch_env();
  int exit_code = 0;
  // Usage errors are the same on every rank: only rank 0 explains them.
  auto options = dtensor::train::parse_args(argc, argv, exit_code, /*quiet=*/env.rank != 0);
  if (!options) return finish(exit_code, env);
  try {
    return finish(dtensor::train::run_training(*options, env), env);
  } catch (const std::exception& e) {
    const std::string message = dtensor::util::error_message(e);
    std::cerr << "dtensor_train: error on rank " << env.rank << ": " << message << std::endl;
    dtensor::comm::report_failure(message);  // the other ranks stop at once, naming this one
    return 1;
  }
}
