#include "options.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dtrun {
namespace {

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

Examples:
  dtrun -n 4 build/apps/demo/dtensor_demo
  dtrun -n 2 --master-port 29500 -- ./my_program --steps 10
)";

bool parse_int(const std::string& text, long lo, long hi, long& out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  out = v;
  return true;
}

bool parse_seconds(const std::string& text, double& out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(v) || v < 0 || v > 86400) return false;
  out = v;
  return true;
}

}  // namespace

std::optional<Options> parse_args(int argc, char** argv, int& exit_code) {
  Options o;
  exit_code = 0;
  auto fail = [&](const std::string& message) -> std::optional<Options> {
    std::fprintf(stderr, "dtrun: %s\nRun 'dtrun --help' for usage.\n", message.c_str());
    exit_code = 2;
    return std::nullopt;
  };

  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // the program starts here
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::fflush(stdout);
      return std::nullopt;
    }
    if (arg == "--no-prefix") {
      o.prefix = false;
      continue;
    }
    // The options below take a value: "--name VALUE", "--name=VALUE", "-n VALUE" or "-nVALUE".
    std::string name = arg;
    std::optional<std::string> value;
    if (arg.starts_with("--")) {
      if (auto eq = arg.find('='); eq != std::string::npos) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
      }
    } else if (arg.size() > 2) {
      name = arg.substr(0, 2);
      value = arg.substr(2);
    }
    if (name != "-n" && name != "--nproc-per-node" && name != "--master-addr" &&
        name != "--master-port" && name != "--grace") {
      return fail("unknown option '" + arg + "'");
    }
    if (!value) {
      if (i + 1 >= argc) return fail(name + " needs a value");
      value = argv[++i];
    }
    if (name == "-n" || name == "--nproc-per-node") {
      long n = 0;
      if (!parse_int(*value, 1, kMaxRanks, n)) {
        return fail("the number of ranks must be an integer from 1 to " +
                    std::to_string(kMaxRanks) + ", got '" + *value + "'");
      }
      o.nproc = static_cast<int>(n);
    } else if (name == "--master-addr") {
      if (value->empty()) return fail("--master-addr must not be empty");
      o.master_addr = *value;
    } else if (name == "--master-port") {
      long port = 0;
      if (!parse_int(*value, 1, 65535, port)) {
        return fail("--master-port must be a port number from 1 to 65535, got '" + *value + "'");
      }
      o.master_port = static_cast<int>(port);
    } else if (!parse_seconds(*value, o.grace_s)) {
      return fail("--grace must be a number of seconds from 0 to 86400, got '" + *value + "'");
    }
  }
  for (; i < argc; ++i) o.command.emplace_back(argv[i]);

  if (o.nproc == 0) return fail("say how many ranks to start with -n N");
  if (o.command.empty())
    return fail("no program to run: dtrun -n N [options] [--] program [args...]");
  return o;
}

}  // namespace dtrun
