#include "options.h"

#include "common/cli.h"

namespace dtrun {
namespace {

namespace cli = dtensor::cli;

constexpr int kMaxRanks = 1024;

constexpr const char* kUsage = R"(Usage: dtrun -n N [options] [--] program [args...]

Starts N ranks of `program` on this machine with the environment torchrun sets, prints
their output line by line prefixed with "[rank R] ", and stops all of them as soon as
one fails.

Options:
  -n, --nproc-per-node N  number of ranks to start (required, 1..1024)
      --nnodes N          number of machines (nodes) of the job, each running one dtrun
                          with the same options but its own --node-rank (default 1)
      --node-rank R       this node's index, 0..N-1; node 0 hosts the rendezvous (rank 0)
      --master-addr ADDR  rendezvous address given to the ranks (default 127.0.0.1; with
                          --nnodes > 1 required: an address of node 0 the others reach)
      --master-port PORT  rendezvous port (default: a free port on 127.0.0.1; required
                          with --nnodes > 1)
      --no-prefix         print the ranks' output as is, without "[rank R] "
      --grace S           seconds from SIGTERM to SIGKILL when stopping ranks (default 5)
      --backend B         collective engine for CPU tensors: gloo (ranks forked by dtrun,
                          TCP on loopback), mpi (ranks started by Open MPI's mpirun,
                          shared-memory collectives; see docs/BACKENDS.md), or auto (the
                          default, or DTENSOR_BACKEND when set): mpi when this build has MPI,
                          mpirun is on PATH, N > 1 and N is at most the number of cores,
                          else gloo. MPI is faster where it runs (TP=2 decoding beats one
                          rank on MPI, not on Gloo; docs/PERFORMANCE.md), but its ranks
                          poll while they wait, so with more ranks than cores they take
                          the CPU from each other; with --nnodes > 1, gloo
  -h, --help              print this help and exit

Each rank gets RANK (node_rank * N + LOCAL_RANK), LOCAL_RANK (0..N-1), WORLD_SIZE
(nnodes * N), LOCAL_WORLD_SIZE (N), GROUP_RANK (the node rank), MASTER_ADDR, MASTER_PORT,
and OMP_NUM_THREADS=1 unless it is already set. Ranks run in
their own process groups with stdin from /dev/null; their stdout goes to dtrun's stdout
and their stderr to dtrun's stderr.

When a rank exits non-zero or is killed by a signal, dtrun gives the other ranks a second
to end on their own, then sends them SIGTERM, SIGKILL after the grace period, and exits
with that rank's code (128+signal for a signal). A rank's last stderr line of the form
"NAME: error on rank R: MESSAGE" is printed at the end, once for every rank that said the
same ("NAME: error on every rank (2 of 2): MESSAGE"). SIGINT and SIGTERM sent to dtrun
are passed on to every rank; a second Ctrl-C kills them at once. Exit status: 0 when every
rank succeeds, 2 for a usage error, 127 (or 126) when the program cannot be found (or
executed).

With --backend mpi, dtrun runs `mpirun -np N --quiet --tag-output` (on PATH), which
starts and stops the ranks; the rendezvous variables and DTENSOR_BACKEND=mpi are passed on
with -x, and dtrun splits mpirun's tagged output back into "[rank R] " lines, so progress
bars redraw in place as with forked ranks. dtrun's exit status is then mpirun's.

Examples:
  dtrun -n 4 build/apps/demo/dtensor_demo
  dtrun -n 2 --backend mpi build/apps/train/dtensor_train --preset demo
  dtrun -n 2 --master-port 29500 -- ./my_program --steps 10
  two machines, 2 ranks each, rendezvous at the first one's address 10.0.0.1:
    (on 10.0.0.1) dtrun -n 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 \
                    --master-port 29500 build/apps/train/dtensor_train --dp-shard 2
    (on the other) dtrun -n 2 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 \
                    --master-port 29500 build/apps/train/dtensor_train --dp-shard 2
)";

}  // namespace

std::optional<Options> parse_args(int argc, char** argv, int& exit_code) {
  Options o;
  CLI::App app("", "dtrun");
  app.add_option("-n,--nproc-per-node", o.nproc)->check(cli::integer(1, kMaxRanks));
  app.add_option("--nnodes", o.nnodes)->check(cli::integer(1, kMaxRanks));
  app.add_option("--node-rank", o.node_rank)->check(cli::integer(0, kMaxRanks - 1));
  auto* addr = app.add_option("--master-addr", o.master_addr)->check(cli::non_empty());
  app.add_option("--master-port", o.master_port)->check(cli::integer(1, 65535));
  app.add_flag_callback("--no-prefix", [&o] { o.prefix = false; })->disable_flag_override();
  app.add_option("--grace", o.grace_s)->check(cli::number(0, 86400));
  app.add_option("--backend", o.backend)->check(cli::one_of({"gloo", "mpi", "auto"}));
  if (auto code = cli::parse(app, argc, argv, kUsage, /*quiet=*/false, &o.command)) {
    exit_code = *code;
    return std::nullopt;
  }
  if (o.nproc == 0) {
    exit_code = cli::usage_error(app, "say how many ranks to start with -n N");
  } else if (o.node_rank >= o.nnodes) {
    exit_code = cli::usage_error(app, "--node-rank " + std::to_string(o.node_rank) +
                                          " is outside 0.." + std::to_string(o.nnodes - 1) +
                                          " (--nnodes " + std::to_string(o.nnodes) + ")");
  } else if (o.nnodes * o.nproc > kMaxRanks) {
    exit_code = cli::usage_error(
        app, "--nnodes x --nproc-per-node is more than " + std::to_string(kMaxRanks) + " ranks");
  } else if (o.nnodes > 1 && (o.master_port == 0 || addr->count() == 0)) {
    exit_code = cli::usage_error(
        app,
        "with --nnodes > 1 every node needs the same --master-addr (an address of node 0 "
        "that the other nodes reach) and --master-port");
  } else if (o.nnodes > 1 && o.backend == "mpi") {
    exit_code = cli::usage_error(
        app,
        "--backend mpi starts one node's ranks with mpirun; for several nodes use mpirun's "
        "own host list (mpirun --host A:2,B:2 ...) instead of dtrun");
  } else if (o.command.empty()) {
    exit_code =
        cli::usage_error(app, "no program to run: dtrun -n N [options] [--] program [args...]");
  } else {
    return o;
  }
  return std::nullopt;
}

}  // namespace dtrun
