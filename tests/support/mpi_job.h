#pragma once
// Tests as ranks of an mpirun job. MPI ranks cannot be forked into a job, so under mpirun every
// process of the job is one rank: run_ranks(n, body) runs `body` in this process when the job
// has n ranks and skips the test otherwise. `mpirun -np 2 test_x` and `mpirun -np 4 test_x`
// together run the 2- and 4-rank tests on the MPI backend (ctest does: tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <vector>

namespace dtensor::testing {

// True when mpirun started this process (OMPI_COMM_WORLD_SIZE is set).
bool in_mpi_job();

// The world sizes among `sizes` this process can run: all of them with forked ranks, only the
// job's own size under mpirun (a test looping over sizes would otherwise be marked skipped by
// the first size the job does not have, hiding the results of the one it does).
std::vector<int> world_sizes_to_run(const std::vector<int>& sizes);

}  // namespace dtensor::testing

// For tests that kill, stop or fork ranks on purpose: they need run_ranks' forked ranks.
#define SKIP_IN_MPI_JOB()                                                                 \
  if (::dtensor::testing::in_mpi_job())                                                   \
  GTEST_SKIP() << "kills, stalls or forks ranks on purpose: runs with forked ranks only " \
                  "(the MPI backend's faults are tested by test_comm_mpi)"
