// oneccl_vs_mpi: float32 all_reduce (sum), all_gather and reduce_scatter on plain MPI and on
// Intel oneCCL, timed side by side in one mpirun job over the same ranks.
//
// Not part of the CMake build: scripts/compare-cpu-engines installs oneCCL into a venv,
// compiles this file with mpicxx and runs it under mpirun (see docs/BACKENDS.md).
//
// Size is the buffer a rank holds in full: all_reduce's buffer, all_gather's output,
// reduce_scatter's input. Each round times `calls` MPI calls and `calls` oneCCL calls (the
// order alternates between rounds so that neither engine always runs on a warmer cache); a
// round's time is the slowest rank's mean per call, a point's time the median over rounds.
// Every engine's last output is checked against the exact sums. The last line is
//   RESULT ranks=N oneccl_vs_mpi_4kib=<mpi time / oneccl time> oneccl_vs_mpi_1mib=...
//          oneccl_vs_mpi_16mib=... oneccl_vs_mpi_all_gather_4kib=... (and reduce_scatter)
// for all_reduce (no op in the key), all_gather and reduce_scatter; above 1: oneCCL is faster.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <oneapi/ccl.hpp>
#include <string>
#include <vector>

namespace {

enum class Op { all_reduce, all_gather, reduce_scatter };
constexpr Op kOps[] = {Op::all_reduce, Op::all_gather, Op::reduce_scatter};

const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce:
      return "all_reduce";
    case Op::all_gather:
      return "all_gather";
    case Op::reduce_scatter:
      return "reduce_scatter";
  }
  return "?";
}

std::string size_label(size_t bytes) {
  if (bytes >= (1u << 20)) return std::to_string(bytes >> 20) + "mib";
  if (bytes >= (1u << 10)) return std::to_string(bytes >> 10) + "kib";
  return std::to_string(bytes) + "b";
}

// Input element i of rank r; small integers, so every sum is exact in float32.
float input_value(int rank, size_t i) {
  return static_cast<float>(rank + 1 + static_cast<int>(i % 5));
}

struct Buffers {
  std::vector<float> in, out;
  size_t in_count = 0, out_count = 0;
};

Buffers make_buffers(Op op, size_t count, int rank, int size) {
  Buffers b;
  const size_t chunk = count / size;
  b.in_count = op == Op::all_gather ? chunk : count;
  b.out_count = op == Op::reduce_scatter ? chunk : count;
  b.in.resize(b.in_count);
  // reduce_scatter's input index is global; all_gather's input is this rank's chunk.
  for (size_t i = 0; i < b.in_count; ++i)
    b.in[i] = op == Op::all_gather ? input_value(rank, rank * chunk + i) : input_value(rank, i);
  b.out.assign(b.out_count, -1.0f);
  return b;
}

// The first element that differs from the exact result, or -1.
long first_wrong(Op op, const Buffers& b, size_t count, int rank, int size) {
  const size_t chunk = count / size;
  const float rank_sum = static_cast<float>(size * (size + 1) / 2);
  for (size_t i = 0; i < b.out_count; ++i) {
    float want;
    if (op == Op::all_gather) {
      want = input_value(static_cast<int>(i / chunk), i);
    } else {
      const size_t global = op == Op::reduce_scatter ? rank * chunk + i : i;
      want = rank_sum + static_cast<float>(size * static_cast<int>(global % 5));
    }
    if (b.out[i] != want) return static_cast<long>(i);
  }
  return -1;
}

void run_mpi(Op op, Buffers& b) {
  switch (op) {
    case Op::all_reduce:
      MPI_Allreduce(b.in.data(), b.out.data(), static_cast<int>(b.in_count), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
      break;
    case Op::all_gather:
      MPI_Allgather(b.in.data(), static_cast<int>(b.in_count), MPI_FLOAT, b.out.data(),
                    static_cast<int>(b.in_count), MPI_FLOAT, MPI_COMM_WORLD);
      break;
    case Op::reduce_scatter:
      MPI_Reduce_scatter_block(b.in.data(), b.out.data(), static_cast<int>(b.out_count), MPI_FLOAT,
                               MPI_SUM, MPI_COMM_WORLD);
      break;
  }
}

void run_ccl(Op op, Buffers& b, const ccl::communicator& comm, const ccl::stream& stream,
             const std::vector<size_t>& gather_counts) {
  switch (op) {
    case Op::all_reduce:
      ccl::allreduce(b.in.data(), b.out.data(), b.in_count, ccl::reduction::sum, comm, stream)
          .wait();
      break;
    case Op::all_gather:
      ccl::allgatherv(b.in.data(), b.in_count, b.out.data(), gather_counts, comm, stream).wait();
      break;
    case Op::reduce_scatter:
      ccl::reduce_scatter(b.in.data(), b.out.data(), b.out_count, ccl::reduction::sum, comm, stream)
          .wait();
      break;
  }
}

// Slowest rank's mean seconds per call of `fn`, called `calls` times after a barrier.
double time_round(int calls, const std::function<void()>& fn) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  for (int c = 0; c < calls; ++c) fn();
  const double mean =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls;
  double slowest = 0;
  MPI_Allreduce(&mean, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  // oneCCL looks for its rank on this host in CCL_LOCAL_RANK/SIZE and warns if they are unset.
  if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) {
    setenv("CCL_LOCAL_RANK", local, 0);
    if (const char* n = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) setenv("CCL_LOCAL_SIZE", n, 0);
  }

  // oneCCL meets through its own key-value store; rank 0 hosts it and MPI hands out the address.
  ccl::init();
  ccl::shared_ptr_class<ccl::kvs> kvs;
  ccl::kvs::address_type address{};
  if (rank == 0) {
    kvs = ccl::create_main_kvs();
    address = kvs->get_address();
  }
  MPI_Bcast(address.data(), static_cast<int>(address.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
  if (rank != 0) kvs = ccl::create_kvs(address);
  auto comm = ccl::create_communicator(size, rank, kvs);
  auto stream = ccl::create_stream();  // a host stream: the collectives run on CPU buffers

  if (rank == 0) {
    char mpi_version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(mpi_version, &length);
    std::string mpi_name(mpi_version, length);
    mpi_name = mpi_name.substr(0, mpi_name.find_first_of(",\n"));
    std::printf("oneCCL %s vs %s, %d ranks; time per call (median over rounds, slowest rank)\n",
                ccl::get_library_version().full, mpi_name.c_str(), size);
    std::printf("%-15s %9s %12s %12s %9s\n", "op", "size", "mpi us", "oneccl us", "mpi/ccl");
  }
  std::string result = "RESULT ranks=" + std::to_string(size);
  bool all_right = true;
  for (Op op : kOps) {
    for (size_t bytes = 16; bytes <= (size_t{64} << 20); bytes *= 4) {
      if (quick && bytes > (size_t{1} << 20)) break;
      const size_t count = bytes / sizeof(float);
      if (count % size != 0) continue;
      // 200 calls per point up to 64 KiB, fewer above (a 64 MiB call takes tens of ms).
      const int calls = bytes <= (64u << 10) ? 5 : bytes <= (1u << 20) ? 2 : 1;
      const int rounds = quick ? 10 : bytes <= (1u << 20) ? 40 : bytes <= (16u << 20) ? 15 : 7;
      Buffers mpi_buf = make_buffers(op, count, rank, size);
      Buffers ccl_buf = make_buffers(op, count, rank, size);
      const std::vector<size_t> gather_counts(size, count / size);
      auto mpi_call = [&] { run_mpi(op, mpi_buf); };
      auto ccl_call = [&] { run_ccl(op, ccl_buf, comm, stream, gather_counts); };
      time_round(2, mpi_call);  // warm-up: connections, buffers, first-touch pages
      time_round(2, ccl_call);
      std::vector<double> mpi_t, ccl_t;
      for (int r = 0; r < rounds; ++r) {
        if (r % 2 == 0) {
          mpi_t.push_back(time_round(calls, mpi_call));
          ccl_t.push_back(time_round(calls, ccl_call));
        } else {
          ccl_t.push_back(time_round(calls, ccl_call));
          mpi_t.push_back(time_round(calls, mpi_call));
        }
      }
      for (auto [engine, buf] : {std::pair{"MPI", &mpi_buf}, std::pair{"oneCCL", &ccl_buf}}) {
        const long wrong = first_wrong(op, *buf, count, rank, size);
        if (wrong >= 0) {
          std::fprintf(stderr,
                       "rank %d: %s %s of %zu bytes: element %ld is %g, not the exact sum\n", rank,
                       engine, op_name(op), bytes, wrong, buf->out[wrong]);
          all_right = false;
        }
      }
      const double mpi_us = median(mpi_t) * 1e6, ccl_us = median(ccl_t) * 1e6;
      if (rank != 0) continue;
      std::printf("%-15s %9s %12.1f %12.1f %9.2f\n", op_name(op), size_label(bytes).c_str(), mpi_us,
                  ccl_us, mpi_us / ccl_us);
      if (bytes == (4u << 10) || bytes == (1u << 20) || bytes == (16u << 20)) {
        const std::string key = op == Op::all_reduce ? "" : std::string(op_name(op)) + "_";
        char ratio[32];
        std::snprintf(ratio, sizeof ratio, "%.3f", mpi_us / ccl_us);
        result += " oneccl_vs_mpi_" + key + size_label(bytes) + "=" + ratio;
      }
    }
  }
  int ok = all_right ? 1 : 0, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) {
    if (all_ok)
      std::printf("%s\n", result.c_str());
    else
      std::fprintf(stderr, "oneccl_vs_mpi: wrong results (see above); no RESULT line\n");
  }
  MPI_Finalize();
  return all_ok ? 0 : 1;
}
