// dtensor_demo: one tensor walks through every DTensor placement transition.
//
//   build/apps/dtrun/dtrun -n 4 build/apps/demo/dtensor_demo [--rows R] [--cols C] [--seed S]
//
// Every rank builds the same seeded tensor. After each redistribute() every rank checks that
// full_tensor() still equals the single-device tensor (for a Partial: the sum of the ranks'
// contributions) and the ranks vote; rank 0 prints one row per transition with the
// collectives CommDebugMode counted, their payload and the time taken.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/cli.h"
#include "dtensor/util/error_message.h"
#include "dtensor/comm/failure.h"
#include "dtensor/dtensor.h"

namespace {

using dtensor::Partial;
using dtensor::Placements;
using dtensor::Replicate;
using dtensor::Shard;

constexpr const char* kUsage = R"(usage: dtensor_demo [--rows R] [--cols C] [--seed S]

Distributes a seeded R x C float tensor over a mesh of all ranks and walks it through every
placement transition: Replicate -> Shard(0) -> Shard(1) -> Replicate, Shard(0) -> Replicate,
Partial -> Replicate, Partial -> Shard(0), and with 4 ranks, on a 2x2 mesh,
[S(0), S(1)] -> [S(1), S(0)] and [S(0), S(0)] -> [S(1), S(1)]. After each step every rank
checks full_tensor() against the single-device tensor; rank 0 prints what each step cost.
Exits with status 1 if any check fails.

Run it on several ranks with the launcher:
  build/apps/dtrun/dtrun -n 4 build/apps/demo/dtensor_demo

options:
  --rows R   rows of the tensor (default 10: uneven shards on 4 ranks)
  --cols C   columns of the tensor (default 6)
  --seed S   seed of the tensor's values (default 0)
  --help     print this help
)";

struct Options {
  int64_t rows = 10;
  int64_t cols = 6;
  int64_t seed = 0;
};

// The options to run with, or nullopt with `exit_code` set (0 after --help, 2 on a usage error).
std::optional<Options> parse_args(int argc, char** argv, int& exit_code) {
  Options o;
  CLI::App app("", "dtensor_demo");
  app.add_option("--rows", o.rows)->check(dtensor::cli::integer(1));
  app.add_option("--cols", o.cols)->check(dtensor::cli::integer(1));
  app.add_option("--seed", o.seed)->check(dtensor::cli::integer(0));
  if (auto code = dtensor::cli::parse(app, argc, argv, kUsage)) {
    exit_code = *code;
    return std::nullopt;
  }
  return o;
}

// "[3, 3, 3, 1]": how Shard splits `n` over `k` ranks (torch.chunk rule).
std::string shard_sizes(int64_t n, int64_t k) {
  std::string s;
  for (int64_t r = 0; r < k; ++r)
    s += (r ? ", " : "") + std::to_string(dtensor::chunk_range(n, k, r).size);
  return "[" + s + "]";
}

// "all_gather_into_tensor x1": the collectives one step issued, without the c10d prefix.
std::string describe(const dtensor::CommCounts& counts) {
  std::string s;
  for (const auto& [type, n] : counts) {
    std::string name = dtensor::comm_type_name(type);
    if (auto dot = name.find('.'); dot != std::string::npos) name = name.substr(dot + 1);
    if (!s.empty()) s += ", ";
    s += name + " x" + std::to_string(n);
  }
  return s.empty() ? "none (local)" : s;
}

// Runs the transitions, checks them on every rank and prints the table on rank 0.
class Walk {
 public:
  explicit Walk(int rank) : rank_(rank) {}

  // Prints on rank 0 only.
  template <typename... Args>
  void say(const Args&... args) const {
    if (rank_ != 0) return;
    (std::cout << ... << args) << std::endl;
  }

  void print_header() const {
    say(std::left, std::setw(3), "#", std::setw(5), "mesh", std::setw(14), "from", std::setw(14),
        "to", std::setw(15), "rank0 local", std::setw(28), "collectives", std::right, std::setw(10),
        "bytes", std::setw(10), "time ms", "  check");
    say(std::string(3 + 5 + 14 + 14 + 15 + 28 + 10 + 10 + 7, '-'));
  }

  // redistribute(dt, to), counted and timed, then checked on every rank: the result must have
  // placements `to` and full_tensor() must equal `expected`. Returns the redistributed DTensor.
  at::Tensor step(const std::string& mesh_name, const at::Tensor& dt, const Placements& to,
                  const at::Tensor& expected) {
    const std::string from = dtensor::to_string(dtensor::placements(dt));
    dtensor::comm::barrier();       // start together, so the time is this step's own
    dtensor::CommDebugMode counts;  // counts only the redistribute below
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor out = dtensor::redistribute(dt, to);
    const auto t1 = std::chrono::steady_clock::now();
    counts.exit();

    int64_t bytes = 0;
    for (const auto& r : counts.records()) bytes += r.bytes;
    const std::string got = dtensor::to_string(dtensor::placements(out));
    const at::Tensor full = dtensor::full_tensor(out);
    bool ok = got == dtensor::to_string(to) && full.sizes() == expected.sizes() &&
              at::equal(full, expected);
    if (!ok) {
      std::cerr << "dtensor_demo: rank " << rank_ << ": step " << count_ + 1 << " " << from
                << " -> " << dtensor::to_string(to) << " gave placements " << got
                << " and a full tensor of shape " << full.sizes() << " (expected "
                << expected.sizes();
      if (full.sizes() == expected.sizes()) {
        std::cerr << ", largest difference " << (full - expected).abs().max().item<float>();
      }
      std::cerr << ")" << std::endl;
    }
    // Every rank votes; the step passes only if it passed everywhere.
    at::Tensor vote = at::tensor({ok ? 1 : 0}, at::kInt);
    ok = dtensor::comm::all_reduce(vote, dtensor::ReduceOp::Min, *dtensor::comm::world_group())
             .item<int>() == 1;

    ++count_;
    if (!ok) ++failures_;
    const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    std::ostringstream time;
    time << std::fixed << std::setprecision(3) << ms;
    say(std::left, std::setw(3), count_, std::setw(5), mesh_name, std::setw(14), from,
        std::setw(14), got, std::setw(15), c10::str(dtensor::local_tensor(out).sizes()),
        std::setw(28), describe(counts.get_comm_counts()), std::right, std::setw(10), bytes,
        std::setw(10), time.str(), "  ", ok ? "OK" : "FAIL");
    return out;
  }

  int count() const { return count_; }
  int failures() const { return failures_; }

 private:
  int rank_;
  int count_ = 0;
  int failures_ = 0;
};

int run(const Options& opt) {
  at::set_num_threads(1);  // one core per rank
  dtensor::comm::init_process_group();
  const int rank = dtensor::comm::get_rank();
  const int64_t world = dtensor::comm::get_world_size();
  Walk walk(rank);

  // Everything below is counted, for the summary at the end.
  dtensor::CommDebugMode whole_run;

  auto mesh = dtensor::init_device_mesh("cpu", {world});
  at::manual_seed(static_cast<uint64_t>(opt.seed));
  const at::Tensor original = at::randn({opt.rows, opt.cols});
  // Partial: rank r contributes parts[r]; whole numbers, so every summation order is exact.
  const at::Tensor parts = at::randint(-9, 10, {world, opt.rows, opt.cols}, at::kFloat);
  const at::Tensor parts_sum = parts.sum(0);

  const char* ranks = world == 1 ? " rank" : " ranks";
  walk.say("dtensor demo: ", world, ranks, ", mesh ", mesh);
  walk.say("tensor: ", opt.rows, " x ", opt.cols, " float32 from seed ", opt.seed,
           " (the same on every rank)");
  const bool uneven = opt.rows % world != 0 || opt.cols % world != 0;
  walk.say(uneven ? "uneven shards" : "shards", " on ", world, ranks, " (torch.chunk rule):");
  walk.say("  Shard(0) splits ", opt.rows, " rows as ", shard_sizes(opt.rows, world));
  walk.say("  Shard(1) splits ", opt.cols, " columns as ", shard_sizes(opt.cols, world));
  walk.say("Partial: each rank holds whole numbers in [-9, 9]; the expected value is their sum");
  walk.say("");
  walk.say(
      "Each row is one redistribute(). collectives: what CommDebugMode counted; bytes: the "
      "payload rank 0");
  walk.say(
      "put into them; time: rank 0's wall clock for the call, waiting for the other ranks "
      "included;");
  walk.say("check: full_tensor() equals the expected tensor on every rank.");
  walk.say("");
  walk.print_header();

  // 1-D mesh over all ranks.
  const auto m1 = std::to_string(world);
  at::Tensor r = dtensor::distribute_tensor(original, mesh, {Replicate()});
  at::Tensor s0 = walk.step(m1, r, {Shard(0)}, original);
  at::Tensor s1 = walk.step(m1, s0, {Shard(1)}, original);
  walk.step(m1, s1, {Replicate()}, original);
  walk.step(m1, dtensor::distribute_tensor(original, mesh, {Shard(0)}), {Replicate()}, original);
  at::Tensor p = dtensor::from_local(parts[rank].clone(), mesh, {Partial()});
  walk.step(m1, p, {Replicate()}, parts_sum);
  walk.step(m1, p, {Shard(0)}, parts_sum);

  // 2x2 mesh: both mesh dims change at once.
  if (world == 4) {
    auto mesh2 = dtensor::init_device_mesh("cpu", {2, 2});
    walk.step("2x2", dtensor::distribute_tensor(original, mesh2, {Shard(0), Shard(1)}),
              {Shard(1), Shard(0)}, original);
    walk.step("2x2", dtensor::distribute_tensor(original, mesh2, {Shard(0), Shard(0)}),
              {Shard(1), Shard(1)}, original);
  } else {
    walk.say("(the 2x2 mesh steps need 4 ranks; this run has ", world, ")");
  }

  whole_run.exit();
  walk.say("");
  walk.say(
      "CommDebugMode over the whole run (the steps above plus distribute_tensor, the "
      "full_tensor() checks and the votes):");
  if (rank == 0) std::cout << whole_run.table() << std::flush;
  walk.say("");
  if (walk.failures() == 0) {
    walk.say("demo: all ", walk.count(), " transitions match the single-device tensor");
    return 0;
  }
  walk.say("demo: ", walk.failures(), " of ", walk.count(),
           " transitions do NOT match the single-device tensor");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  const auto options = parse_args(argc, argv, exit_code);
  if (!options) return exit_code;
  try {
    return run(*options);
  } catch (const std::exception& e) {
    const std::string message = dtensor::util::error_message(e);
    std::cerr << "dtensor_demo: " << message << std::endl;
    dtensor::comm::report_failure(message);
  }
  return 1;
}
