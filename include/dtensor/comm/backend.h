#pragma once
// Which collective engine CPU tensors use. init_process_group() picks it from DTENSOR_BACKEND
// (gloo, mpi, nccl or auto; unset = auto): auto means MPI when mpirun started the ranks
// (OMPI_COMM_WORLD_RANK is set) and this build has MPI, else Gloo. "nccl" means NCCL for CUDA
// tensors and Gloo for CPU ones; CUDA tensors always use NCCL. See docs/BACKENDS.md.
#include <string>

namespace dtensor::comm {

/// True when this build has the MPI backend (an MPI library was found at configure time).
bool has_mpi();

/// The CPU engine init_process_group chose: "gloo" or "mpi".
std::string cpu_backend_name();

}  // namespace dtensor::comm
