// dtensor_train: tensor-parallel training of the bundled Llama-style model on the ranks of a
// launch (dtrun, torchrun --no-python, srun, mpirun), or alone as one rank. See --help.
#include <ATen/Parallel.h>

#include <cstdlib>
#include <iostream>

#include "dtensor/comm/process_group.h"
#include "options.h"
#include "train_run.h"

int main(int argc, char** argv) {
  const auto env = dtensor::comm::read_launch_env();
  int exit_code = 0;
  // Usage errors are the same on every rank: only rank 0 explains them.
  auto options = dtensor::train::parse_args(argc, argv, exit_code, /*quiet=*/env.rank != 0);
  if (!options) return exit_code;
  try {
    return dtensor::train::run_training(*options, env);
  } catch (const std::exception& e) {
    std::cerr << "dtensor_train: error on rank " << env.rank << ": " << e.what() << std::endl;
    return 1;
  }
}
