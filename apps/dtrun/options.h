#pragma once
// Command-line options of dtrun.
#include <optional>
#include <string>
#include <vector>

namespace dtrun {

struct Options {
  int nproc = 0;  // ranks on this node
  // Several machines (nodes), as torchrun --nnodes/--node-rank: this node starts global ranks
  // node_rank * nproc .. node_rank * nproc + nproc - 1 of nnodes * nproc.
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free port on 127.0.0.1 (one node only)
  bool prefix = true;
  double grace_s = 5.0;
  // Collective engine of the ranks' CPU tensors (DTENSOR_BACKEND): "" leaves the ranks' own
  // choice, "gloo" forces Gloo, "mpi" starts the ranks with mpirun instead (Open MPI).
  std::string backend;
  std::vector<std::string> command;  // program and its arguments
};

// Parses argv. Returns the options to run with, or nullopt with `exit_code` set after the
// help text (0) or a usage error (2) has been printed.
std::optional<Options> parse_args(int argc, char** argv, int& exit_code);

}  // namespace dtrun
