// bench_collectives: latency and bandwidth of all_reduce, all_gather and reduce_scatter on the
// two CPU engines, Gloo and MPI, side by side in the same mpirun job.
//
//   build/bench/bench_collectives [--quick] [--ranks 2,4] [--svg FILE] [--csv FILE]
//   scripts/bench collectives
//
// Started by hand it runs itself under mpirun once per rank count (2 and 4 by default); every
// rank then creates both c10d backends over the same ranks (Gloo over loopback TCP with its own
// store, MPI on a communicator of the job) and times each collective on float32 buffers from
// 16 B to 64 MiB. Size is the buffer a rank holds in full: all_reduce's tensor, all_gather's
// output, reduce_scatter's input. A point's time is the median over rounds of the slowest
// rank's mean time per call. The last line is machine-readable:
//   RESULT small_allreduce_speedup=<gloo/mpi at 4 KiB, 2 ranks> bw_ratio_16mib=<mpi/gloo
//   bandwidth at 16 MiB, 2 ranks> (and the same with an _np4 suffix for 4 ranks)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "comm/backends.h"  // the engines' factories (internal to the library)
#include "dtensor/comm/backend.h"
#include "dtensor/comm/process_group.h"

namespace {

constexpr const char* kUsage =
    R"(usage: bench_collectives [--quick] [--ranks LIST] [--svg FILE] [--csv FILE]

Times all_reduce (sum), all_gather and reduce_scatter (sum) of float32 buffers from 16 B to
64 MiB on Gloo and on MPI, both created in the same mpirun job, for each rank count in LIST
(default 2,4). Prints a table per rank count and, as the last line,
  RESULT small_allreduce_speedup=<gloo/mpi at 4 KiB> bw_ratio_16mib=<mpi/gloo at 16 MiB> ...
(2 ranks; keys with _np4 for 4 ranks).

options:
  --quick       few sizes and iterations: a smoke test, not a measurement
  --ranks LIST  rank counts, comma-separated (default 2,4)
  --svg FILE    write a latency plot (log-log) of every point
  --csv FILE    write every point as CSV
  --help        print this help
Ranks are bound to cores (--bind-to core) when there are at least as many cores as ranks.
)";

using Clock = std::chrono::steady_clock;

struct Point {
  int ranks = 0;
  std::string op, engine;
  int64_t bytes = 0;
  double us = 0;
};

std::string human_bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  double v = static_cast<double>(b);
  while (v >= 1024 && u < 3) v /= 1024, ++u;
  std::ostringstream o;
  o << v << " " << units[u];
  return o.str();
}

// Bytes one rank sends per call in a bandwidth-optimal algorithm, over the buffer size (as
// nccl-tests' "bus bandwidth").
double bus_factor(const std::string& op, int n) {
  return op == "all_reduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

// ---------------------------------------------------------------------------------------------
// One rank of the mpirun job.

struct Engines {
  c10::intrusive_ptr<c10d::Backend> gloo, mpi;
};

// One call of `op` on `b` with buffers for `bytes`.
struct Buffers {
  at::Tensor full, part;
};

void call(c10d::Backend& b, const std::string& op, Buffers& buf) {
  if (op == "all_reduce") {
    std::vector<at::Tensor> v{buf.full};
    b.allreduce(v)->wait();
  } else if (op == "all_gather") {
    b._allgather_base(buf.full, buf.part)->wait();
  } else {
    b._reduce_scatter_base(buf.part, buf.full)->wait();
  }
}

// The slowest rank's value (through MPI, which every rank has).
double max_over_ranks(c10d::Backend& mpi, double v) {
  std::vector<at::Tensor> t{at::full({1}, v, at::kDouble)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
  mpi.allreduce(t, o)->wait();
  return t[0].item<double>();
}

double time_point(Engines& e, c10d::Backend& b, const std::string& op, int64_t bytes, int n,
                  bool quick) {
  const int64_t numel = std::max<int64_t>(n, bytes / 4 / n * n);
  Buffers buf{at::ones({numel}), at::ones({numel / n})};
  for (int i = 0; i < 2; ++i) call(b, op, buf);  // warm-up (connections, caches)
  // Iterations per round: about 40 ms (5 ms when quick) of calls, the same on every rank.
  b.barrier()->wait();
  auto t0 = Clock::now();
  call(b, op, buf);
  const double one =
      max_over_ranks(*e.mpi, std::chrono::duration<double>(Clock::now() - t0).count());
  const double budget = quick ? 0.005 : 0.04;
  const int iters = static_cast<int>(std::clamp(budget / std::max(one, 1e-7), 1.0, 2000.0));
  const int rounds = quick ? 2 : 7;
  std::vector<double> per_call;
  for (int r = 0; r < rounds; ++r) {
    b.barrier()->wait();
    t0 = Clock::now();
    for (int i = 0; i < iters; ++i) call(b, op, buf);
    const double mine = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
    per_call.push_back(max_over_ranks(*e.mpi, mine));
  }
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2] * 1e6;
}

int run_rank(bool quick) {
  at::set_num_threads(1);
  const auto env = dtensor::comm::read_launch_env();
  const int rank = env.rank, n = env.world_size;
  // Gloo meets through its own store (rank 0 hosts it), as init_process_group would.
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = rank == 0;
  so.numWorkers = n;
  so.timeout = std::chrono::seconds(120);
  auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  Engines e;
  std::vector<int> all(n);
  for (int i = 0; i < n; ++i) all[i] = i;
  e.mpi = dtensor::comm::detail::make_mpi_backend(all, rank, "bench");
  if (!e.mpi) {
    std::cerr << "bench_collectives: this build has no MPI backend (install libopenmpi-dev, "
                 "re-run CMake)\n";
    return 1;
  }
  e.gloo = dtensor::comm::detail::make_gloo_backend(
      c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, n, std::chrono::seconds(120),
      std::chrono::seconds(120), "127.0.0.1");
  std::vector<int64_t> sizes;
  for (int64_t b = 16; b <= (64 << 20); b *= 4) sizes.push_back(b);
  if (quick) sizes = {16, 4096, 1 << 20, 16 << 20};
  for (const std::string op : {"all_reduce", "all_gather", "reduce_scatter"}) {
    for (int64_t bytes : sizes) {
      const double g = time_point(e, *e.gloo, op, bytes, n, quick);
      const double m = time_point(e, *e.mpi, op, bytes, n, quick);
      if (rank == 0) {
        std::printf("POINT %d %s gloo %lld %.3f\n", n, op.c_str(), static_cast<long long>(bytes),
                    g);
        std::printf("POINT %d %s mpi %lld %.3f\n", n, op.c_str(), static_cast<long long>(bytes), m);
        std::fflush(stdout);
      }
    }
  }
  e.gloo.reset();
  e.mpi.reset();
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Launcher: one mpirun job per rank count; collects the points.

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

std::vector<Point> run_job(int ranks, bool quick, const std::string& self, int* status) {
  const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
  const std::string bind = ranks <= cores ? "core" : "none";
  const std::string cmd = std::string(MPIEXEC_PATH) +
                          " --allow-run-as-root --oversubscribe --bind-to " + bind + " -np " +
                          std::to_string(ranks) + " -x OMP_NUM_THREADS=1 -x MASTER_ADDR=127.0.0.1" +
                          " -x MASTER_PORT=" + std::to_string(free_port()) + " " + self +
                          " --rank" + (quick ? " --quick" : "");
  std::vector<Point> points;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    *status = 1;
    return points;
  }
  char line[512];
  while (std::fgets(line, sizeof(line), p)) {
    std::istringstream in(line);
    std::string tag;
    Point pt;
    if (in >> tag && tag == "POINT" && in >> pt.ranks >> pt.op >> pt.engine >> pt.bytes >> pt.us) {
      points.push_back(pt);
    } else {
      std::fputs(line, stderr);
    }
  }
  *status = ::pclose(p);
  return points;
}

double find(const std::vector<Point>& pts, int n, const std::string& op, const std::string& eng,
            int64_t bytes) {
  for (const auto& p : pts) {
    if (p.ranks == n && p.op == op && p.engine == eng && p.bytes == bytes) return p.us;
  }
  return NAN;
}

void print_table(const std::vector<Point>& pts, int n) {
  std::printf("\n%d ranks (float32, sum; time = median of the slowest rank's mean per call)\n", n);
  std::printf("%-15s %10s %12s %12s %9s %13s %13s\n", "collective", "size", "gloo us", "mpi us",
              "speedup", "gloo busGB/s", "mpi busGB/s");
  for (const auto& p : pts) {
    if (p.ranks != n || p.engine != "gloo") continue;
    const double g = p.us, m = find(pts, n, p.op, "mpi", p.bytes);
    const double f = bus_factor(p.op, n) * p.bytes / 1e3;  // bytes/us -> GB/s
    std::printf("%-15s %10s %12.1f %12.1f %8.1fx %13.3f %13.3f\n", p.op.c_str(),
                human_bytes(p.bytes).c_str(), g, m, g / m, f / g, f / m);
  }
}

// Latency against size, log-log, one line per (ranks, collective, engine).
void write_svg(const std::vector<Point>& pts, const std::string& path) {
  const double W = 760, H = 480, L = 70, R = 230, T = 30, B = 50;
  double xmin = 1e300, xmax = 0, ymin = 1e300, ymax = 0;
  for (const auto& p : pts) {
    xmin = std::min(xmin, double(p.bytes)), xmax = std::max(xmax, double(p.bytes));
    ymin = std::min(ymin, p.us), ymax = std::max(ymax, p.us);
  }
  ymin = std::pow(10, std::floor(std::log10(ymin))),
  ymax = std::pow(10, std::ceil(std::log10(ymax)));
  auto X = [&](double b) {
    return L +
           (W - L - R) * (std::log10(b) - std::log10(xmin)) / (std::log10(xmax) - std::log10(xmin));
  };
  auto Y = [&](double us) {
    return H - B -
           (H - T - B) * (std::log10(us) - std::log10(ymin)) /
               (std::log10(ymax) - std::log10(ymin));
  };
  std::ofstream o(path);
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' "
       "fill='white'/>\n";
  o << "<text x='" << L
    << "' y='18' font-size='14'>Collective latency, Gloo vs MPI (float32, "
       "log-log)</text>\n";
  for (double y = ymin; y <= ymax * 1.001; y *= 10) {
    o << "<line x1='" << L << "' x2='" << W - R << "' y1='" << Y(y) << "' y2='" << Y(y)
      << "' stroke='#ddd'/><text x='" << L - 6 << "' y='" << Y(y) + 4 << "' text-anchor='end'>"
      << (y >= 1000 ? std::to_string(int64_t(y / 1000)) + " ms"
                    : std::to_string(int64_t(y)) + " us")
      << "</text>\n";
  }
  for (double x = xmin; x <= xmax * 1.001; x *= 16) {
    o << "<line x1='" << X(x) << "' x2='" << X(x) << "' y1='" << T << "' y2='" << H - B
      << "' stroke='#ddd'/><text x='" << X(x) << "' y='" << H - B + 16 << "' text-anchor='middle'>"
      << human_bytes(int64_t(x)) << "</text>\n";
  }
  o << "<text x='" << (L + W - R) / 2 << "' y='" << H - 12
    << "' text-anchor='middle'>buffer size per rank</text>\n";
  std::map<std::string, std::vector<Point>> lines;
  for (const auto& p : pts)
    lines[std::to_string(p.ranks) + " ranks " + p.op + " " + p.engine].push_back(p);
  const std::map<std::string, std::string> colors{
      {"all_reduce", "#1f77b4"}, {"all_gather", "#2ca02c"}, {"reduce_scatter", "#d62728"}};
  int k = 0;
  for (const auto& [name, line] : lines) {
    const auto& p0 = line.front();
    const std::string dash = p0.engine == "gloo" ? " stroke-dasharray='6,4'" : "";
    const std::string width = p0.ranks == 2 ? "2" : "1";
    o << "<polyline fill='none' stroke='" << colors.at(p0.op) << "' stroke-width='" << width << "'"
      << dash << " points='";
    for (const auto& p : line) o << X(double(p.bytes)) << "," << Y(p.us) << " ";
    o << "'/>\n";
    const double ly = T + 14 + 16 * k++;
    o << "<line x1='" << W - R + 12 << "' x2='" << W - R + 40 << "' y1='" << ly - 4 << "' y2='"
      << ly - 4 << "' stroke='" << colors.at(p0.op) << "' stroke-width='" << width << "'" << dash
      << "/><text x='" << W - R + 46 << "' y='" << ly << "'>" << name << "</text>\n";
  }
  o << "</svg>\n";
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, rank_mode = false;
  std::vector<int> rank_counts{2, 4};
  std::string svg, csv;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "bench_collectives: " << a << " needs a value\n" << kUsage;
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      return 0;
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--rank") {
      rank_mode = true;
    } else if (a == "--svg") {
      svg = value();
    } else if (a == "--csv") {
      csv = value();
    } else if (a == "--ranks") {
      rank_counts.clear();
      std::istringstream in(value());
      std::string item;
      while (std::getline(in, item, ',')) rank_counts.push_back(std::atoi(item.c_str()));
    } else {
      std::cerr << "bench_collectives: unknown argument '" << a << "'\n" << kUsage;
      return 2;
    }
  }
  try {
    if (rank_mode) return run_rank(quick);
  } catch (const std::exception& e) {
    std::cerr << "bench_collectives: rank failed: " << e.what() << "\n";
    return 1;
  }
  if (!dtensor::comm::has_mpi()) {
    std::cerr << "bench_collectives: this build has no MPI backend: install libopenmpi-dev "
                 "(scripts/setup does) and re-run CMake\n";
    return 1;
  }
  char self[4096] = {0};
  if (::readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return 1;
  std::printf("bench_collectives: Gloo (loopback TCP) vs MPI (%s), %ld cores%s\n", MPIEXEC_PATH,
              ::sysconf(_SC_NPROCESSORS_ONLN), quick ? ", --quick" : "");
  std::vector<Point> all;
  for (int n : rank_counts) {
    int status = 0;
    auto pts = run_job(n, quick, self, &status);
    if (status != 0 || pts.empty()) {
      std::cerr << "bench_collectives: the mpirun job with " << n << " ranks failed (status "
                << status << ")\n";
      return 1;
    }
    print_table(pts, n);
    all.insert(all.end(), pts.begin(), pts.end());
  }
  if (!csv.empty()) {
    std::ofstream o(csv);
    o << "ranks,collective,engine,bytes,us\n";
    for (const auto& p : all)
      o << p.ranks << "," << p.op << "," << p.engine << "," << p.bytes << "," << p.us << "\n";
  }
  if (!svg.empty()) write_svg(all, svg);
  std::printf("\nRESULT");
  for (int n : rank_counts) {
    const std::string suffix = n == rank_counts.front() ? "" : "_np" + std::to_string(n);
    const double small =
        find(all, n, "all_reduce", "gloo", 4096) / find(all, n, "all_reduce", "mpi", 4096);
    const double bw =
        find(all, n, "all_reduce", "gloo", 16 << 20) / find(all, n, "all_reduce", "mpi", 16 << 20);
    std::printf(" small_allreduce_speedup%s=%.1f bw_ratio_16mib%s=%.2f", suffix.c_str(), small,
                suffix.c_str(), bw);
  }
  std::printf("\n");
  return 0;
}
