// Rendezvous from the launcher's environment, and failure modes: a rank that dies, never joins
// or hangs makes the others fail within the timeout, naming the rank and the collective.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/mpi_job.h"
#include "support/timing.h"

using namespace dtensor;
using dtensor::testing::now;
using dtensor::testing::run_ranks;
using dtensor::testing::seconds_since;

namespace {

struct EnvGuard {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  void set(const char* k, const char* v) {
    const char* old = std::getenv(k);
    saved.push_back({k, old ? std::optional<std::string>(old) : std::nullopt});
    if (v) {
      ::setenv(k, v, 1);
    } else {
      ::unsetenv(k);
    }
  }
  ~EnvGuard() {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      if (it->second) {
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        ::unsetenv(it->first.c_str());
      }
    }
  }
};

void clear_launch_env(EnvGuard& g) {
  for (const char* k :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "PMI_RANK",
        "PMI_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    g.set(k, nullptr);
  }
}

}  // namespace

TEST(LaunchEnv, ReadsTorchrunVariables) {
  EnvGuard g;
  clear_launch_env(g);
  g.set("RANK", "3");
  g.set("WORLD_SIZE", "8");
  g.set("LOCAL_RANK", "1");
  g.set("MASTER_ADDR", "10.0.0.5");
  g.set("MASTER_PORT", "1234");
  auto e = comm::read_launch_env();
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.5");
  EXPECT_EQ(e.master_port, 1234);
  EXPECT_EQ(e.source, "torchrun");
}

TEST(LaunchEnv, FallsBackToOpenMpiThenSlurmVariables) {
  EnvGuard g;
  clear_launch_env(g);
  g.set("OMPI_COMM_WORLD_RANK", "2");
  g.set("OMPI_COMM_WORLD_SIZE", "4");
  g.set("OMPI_COMM_WORLD_LOCAL_RANK", "0");
  g.set("SLURM_PROCID", "9");
  g.set("SLURM_NTASKS", "16");
  auto e = comm::read_launch_env();
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.source, "ompi");
  g.set("OMPI_COMM_WORLD_RANK", nullptr);
  auto s = comm::read_launch_env();
  EXPECT_EQ(s.rank, 9);
  EXPECT_EQ(s.world_size, 16);
  EXPECT_EQ(s.source, "slurm");
  EXPECT_EQ(s.master_addr, "127.0.0.1");
}

TEST(LaunchEnv, RejectsRankOutsideWorldAndNonNumbers) {
  EnvGuard g;
  clear_launch_env(g);
  g.set("RANK", "4");
  g.set("WORLD_SIZE", "4");
  EXPECT_THROW(comm::read_launch_env(), c10::Error);
  g.set("RANK", "x");
  EXPECT_THROW(comm::read_launch_env(), c10::Error);
}

TEST(Rendezvous, RankThatNeverJoinsFailsTheOthersWithinTheTimeout) {
  SKIP_IN_MPI_JOB();
  run_ranks(2,
            [](int rank) {
              if (rank == 1) {
                std::this_thread::sleep_for(std::chrono::seconds(3));
                return;  // never joined
              }
              auto t0 = now();
              try {
                comm::init_process_group();
                ADD_FAILURE() << "rendezvous should have timed out";
              } catch (const c10::Error& e) {
                const std::string msg = e.what_without_backtrace();
                EXPECT_NE(msg.find("rank 0 could not rendezvous with 2 ranks"), std::string::npos)
                    << msg;
                EXPECT_LT(seconds_since(t0), 5.0);
              }
            },
            {.comm_timeout = std::chrono::seconds(2),
             .connect_timeout = std::chrono::seconds(2),
             .init_process_group = false});
}

TEST(Collectives, DeadPeerFailsTheCollectiveNamingRankAndCollective) {
  SKIP_IN_MPI_JOB();
  run_ranks(2,
            [](int rank) {
              auto world = comm::world_group();
              comm::all_reduce(at::ones({4}), ReduceOp::Sum, *world);  // both connected
              if (rank == 1) ::_exit(0);                               // dies without a word
              auto t0 = now();
              try {
                comm::all_reduce(at::ones({4}), ReduceOp::Sum, *world);
                ADD_FAILURE() << "all_reduce with a dead peer should fail";
              } catch (const c10::Error& e) {
                const std::string msg = e.what_without_backtrace();
                EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
                EXPECT_NE(msg.find("all_reduce"), std::string::npos) << msg;
                EXPECT_LT(seconds_since(t0), 5.0);
              }
            },
            {.comm_timeout = std::chrono::seconds(3)});
}

TEST(Collectives, HungPeerTimesOutInsteadOfHanging) {
  SKIP_IN_MPI_JOB();
  run_ranks(2,
            [](int rank) {
              auto world = comm::world_group();
              comm::all_reduce(at::ones({4}), ReduceOp::Sum, *world);
              if (rank == 1) {
                std::this_thread::sleep_for(std::chrono::seconds(5));  // alive but silent
                return;
              }
              auto t0 = now();
              try {
                comm::all_gather_into_tensor(at::ones({4}), 0, *world);
                ADD_FAILURE() << "all_gather with a silent peer should time out";
              } catch (const c10::Error& e) {
                const std::string msg = e.what_without_backtrace();
                EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
                EXPECT_NE(msg.find("all_gather_into_tensor"), std::string::npos) << msg;
                EXPECT_LT(seconds_since(t0), 4.5);
              }
            },
            {.comm_timeout = std::chrono::seconds(2)});
}

// A group connects at its first collective. Reaching it seconds after a peer (a busy machine,
// a rank still building its part of a model) is not a failure: that wait has its own bound,
// DTENSOR_CONNECT_TIMEOUT_S, not the collective timeout that detects a failed peer.
TEST(Collectives, FirstCollectiveWaitsForAMemberSlowerThanTheTimeout) {
  SKIP_IN_MPI_JOB();
  run_ranks(2,
            [](int rank) {
              if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(3500));
              auto sum = comm::all_reduce(at::ones({4}), ReduceOp::Sum, *comm::world_group());
              EXPECT_TENSOR_EQ(sum, at::full({4}, 2.0f));
            },
            {.comm_timeout = std::chrono::seconds(2)});
}

TEST(Collectives, FirstCollectiveNamesTheMemberThatNeverArrives) {
  SKIP_IN_MPI_JOB();
  run_ranks(2,
            [](int rank) {
              if (rank == 1) {
                std::this_thread::sleep_for(std::chrono::seconds(10));  // joined, then silent
                return;
              }
              auto t0 = now();
              const std::string msg = dtensor::testing::message_of(
                  [] { comm::all_reduce(at::ones({4}), ReduceOp::Sum, *comm::world_group()); });
              EXPECT_NE(msg.find("rank 0: connecting group world at its first collective: "
                                 "rank(s) 1 did not arrive within 5 s"),
                        std::string::npos)
                  << msg;
              EXPECT_LT(seconds_since(t0), 8.0);
            },
            // The connect bound also bounds joining, which a loaded machine can stretch past 3 s.
            {.comm_timeout = std::chrono::seconds(2), .connect_timeout = std::chrono::seconds(5)});
}

TEST(Collectives, ReduceOpsGatherScatterAndBroadcastMatchLocalComputation) {
  run_ranks(3, [](int rank) {
    auto& g = *comm::world_group();
    auto mine = at::arange(6, at::kDouble).view({2, 3}) + rank;
    auto all = at::stack({at::arange(6, at::kDouble).view({2, 3}),
                          at::arange(6, at::kDouble).view({2, 3}) + 1,
                          at::arange(6, at::kDouble).view({2, 3}) + 2});
    EXPECT_TENSOR_EQ(comm::all_reduce(mine, ReduceOp::Sum, g), all.sum(0));
    EXPECT_TENSOR_EQ(comm::all_reduce(mine, ReduceOp::Avg, g), all.mean(0));
    EXPECT_TENSOR_EQ(comm::all_reduce(mine, ReduceOp::Max, g), std::get<0>(all.max(0)));
    EXPECT_TENSOR_EQ(comm::all_reduce(mine, ReduceOp::Min, g), std::get<0>(all.min(0)));
    EXPECT_TENSOR_EQ(mine, at::arange(6, at::kDouble).view({2, 3}) + rank);  // out-of-place
    EXPECT_TENSOR_EQ(comm::all_gather_into_tensor(mine, 1, g), at::cat(all.unbind(0), 1));
    auto big = at::arange(18, at::kDouble).view({3, 6}) * (rank + 1);
    auto total = at::arange(18, at::kDouble).view({3, 6}) * 6;
    EXPECT_TENSOR_EQ(comm::reduce_scatter_tensor(big, 1, ReduceOp::Sum, g),
                     total.chunk(3, 1)[rank]);
    EXPECT_TENSOR_EQ(comm::reduce_scatter_tensor(big, 0, ReduceOp::Max, g),
                     (at::arange(18, at::kDouble).view({3, 6}) * 3).chunk(3, 0)[rank]);
    auto a2a = at::full({3, 2}, static_cast<double>(rank), at::kDouble);
    auto got = comm::all_to_all_single(a2a, 0, 1, g);  // chunk r of every rank, side by side
    EXPECT_TENSOR_EQ(got, at::cat({at::zeros({1, 2}, at::kDouble), at::ones({1, 2}, at::kDouble),
                                   at::full({1, 2}, 2.0, at::kDouble)},
                                  1));
    // Uneven: rank r sends r + i rows to rank i (zero rows included); its row j holds 100 r + j.
    auto rows_of = [](int r, int64_t first, int64_t n) {
      return (at::arange(first, first + n, at::kDouble) + 100 * r).unsqueeze(1).repeat({1, 2});
    };
    for (at::ScalarType dtype : {at::kDouble, at::kBFloat16, at::kLong}) {
      std::vector<int64_t> sent, received;
      std::vector<at::Tensor> expected;
      for (int i = 0; i < 3; ++i) {
        sent.push_back(rank + i);
        received.push_back(i + rank);
        int64_t first = 0;  // rank i's first row for this rank
        for (int j = 0; j < rank; ++j) first += i + j;
        expected.push_back(rows_of(i, first, i + rank));
      }
      const at::Tensor rows = rows_of(rank, 0, 3 * rank + 3).to(dtype);
      EXPECT_TENSOR_EQ(comm::all_to_all_single(rows, received, sent, g).to(at::kDouble),
                       at::cat(expected));
    }
    EXPECT_TENSOR_EQ(comm::broadcast(mine, 2, g), at::arange(6, at::kDouble).view({2, 3}) + 2);
    std::vector<at::Tensor> parts;
    if (rank == 1) {
      for (int r = 0; r < 3; ++r) parts.push_back(at::full({2}, 10.0 * r, at::kDouble));
    }
    EXPECT_TENSOR_EQ(comm::scatter(parts, at::empty({2}, at::kDouble), 1, g),
                     at::full({2}, 10.0 * rank, at::kDouble));
  });
}

TEST(CommDebugMode, CountsByTypeAndEnterClears) {
  run_ranks(2, [](int) {
    auto& g = *comm::world_group();
    CommDebugMode outer;
    CommDebugMode inner;
    comm::all_reduce(at::ones({2}), ReduceOp::Sum, g);
    comm::all_gather_into_tensor(at::ones({2}), 0, g);
    comm::all_gather_into_tensor(at::ones({2}), 0, g);
    EXPECT_EQ(inner.get_comm_counts(),
              (CommCounts{{CommType::all_reduce, 1}, {CommType::all_gather_into_tensor, 2}}));
    EXPECT_EQ(outer.get_total_counts(), 3);
    inner.enter();
    EXPECT_EQ(inner.get_total_counts(), 0);
    inner.exit();
    comm::all_reduce(at::ones({2}), ReduceOp::Sum, g);
    EXPECT_EQ(inner.get_total_counts(), 0);
    EXPECT_EQ(outer.get_total_counts(), 4);
    const std::string t = outer.table();
    EXPECT_NE(t.find("c10d_functional.all_gather_into_tensor"), std::string::npos) << t;
    EXPECT_NE(t.find("total"), std::string::npos) << t;
  });
}

TEST(CommDebugMode, ModuleCountsIncludeChildrenAndSplitForwardBackward) {
  run_ranks(2, [](int) {
    auto& g = *comm::world_group();
    CommDebugMode comm_mode;
    {
      ModuleScope a("Model");
      {
        ModuleScope b("Model.layers.0");
        comm::all_reduce(at::ones({2}), ReduceOp::Sum, g);
        BackwardScope bw;
        comm::all_gather_into_tensor(at::ones({2}), 0, g);
      }
    }
    auto m = comm_mode.comm_module_counts();
    EXPECT_EQ(m["Global"]["forward"][CommType::all_reduce], 1);
    EXPECT_EQ(m["Model"]["forward"][CommType::all_reduce], 1);
    EXPECT_EQ(m.count("Model.layers"), 0u);  // a path prefix, not a module that ran
    EXPECT_EQ(m["Model.layers.0"]["backward"][CommType::all_gather_into_tensor], 1);
    EXPECT_EQ(m["Model.layers.0"]["forward"].count(CommType::all_gather_into_tensor), 0u);
  });
}
