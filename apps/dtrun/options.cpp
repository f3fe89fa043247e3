#include "options.h"

#include "cli/cli.h"

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
      --master-addr ADDR  rendezvous address given to the ranks (default 127.0.0.1)
      --master-port PORT  rendezvous port (default: a free port on 127.0.0.1)
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
                          the CPU from each other
  -h, --help              print this help and exit

Each rank gets RANK and LOCAL_RANK (0..N-1), WORLD_SIZE and LOCAL_WORLD_SIZE (N),
MASTER_ADDR, MASTER_PORT, and OMP_NUM_THREADS=1 unless it is already set. Ranks run in
their own process groups with stdin from /dev/null; their stdout goes to dtrun's stdout
and their stderr to dtrun's stderr.

When a rank exits non-zero or is killed by a signal, dtrun sends SIGTERM to the other
ranks, SIGKILL after the grace period, and exits with that rank's code (128+signal for a
signal). SIGINT and SIGTERM sent to dtrun are passed on to every rank; a second Ctrl-C
kills them at once. Exit status: 0 when every rank succeeds, 2 for a usage error, 127
(or 126) when the program cannot be found (or executed).

With --backend mpi, dtrun runs `mpirun -np N --tag-output` (it must be on PATH), which
starts and stops the ranks; the rendezvous variables and DTENSOR_BACKEND=mpi are passed on
with -x, and dtrun splits mpirun's tagged output back into "[rank R] " lines, so progress
bars redraw in place as with forked ranks. dtrun's exit status is then mpirun's.

Examples:
  dtrun -n 4 build/apps/demo/dtensor_demo
  dtrun -n 2 --backend mpi build/apps/train/dtensor_train --preset demo
  dtrun -n 2 --master-port 29500 -- ./my_program --steps 10
)";

}  // namespace

std::optional<Options> parse_args(int argc, char** argv, int& exit_code) {
  Options o;
  CLI::App app("", "dtrun");
  app.add_option("-n,--nproc-per-node", o.nproc)->check(cli::integer(1, kMaxRanks));
  app.add_option("--master-addr", o.master_addr)->check(cli::non_empty());
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
  } else if (o.command.empty()) {
    exit_code =
        cli::usage_error(app, "no program to run: dtrun -n N [options] [--] program [args...]");
  } else {
    return o;
  }
  return std::nullopt;
}

}  // namespace dtrun
