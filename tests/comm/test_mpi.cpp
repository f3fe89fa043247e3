// The MPI backend: backend selection, every c10d operation the library (or a later pipeline
// stage) issues, and the no-hang guarantee when a peer stops or dies inside an MPI call.
//
// The operation tests run as ranks of an mpirun job (ctest's test_comm_mpi_np2 entry); the
// fault tests start their own mpirun job and read what its ranks print.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "common/local_ranks.h"
#include "dtensor/comm/backend.h"
#include "dtensor/dtensor.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/mpi_job.h"

using namespace dtensor;
using dtensor::testing::run_ranks;

#ifndef MPIEXEC_PATH
#define MPIEXEC_PATH "mpirun"
#endif

namespace {

at::Tensor seq(int64_t n, at::ScalarType dtype, double offset = 0) {
  return (at::arange(n, at::kDouble) + offset).to(dtype);
}

void expect_done(const c10::intrusive_ptr<c10d::Work>& w) {
  w->wait();
  EXPECT_TRUE(w->isCompleted());
  EXPECT_TRUE(w->isSuccess());
  EXPECT_FALSE(w->exception());
}

}  // namespace

TEST(BackendSelection, UnknownBackendIsRefusedNamingTheChoices) {
  SKIP_IN_MPI_JOB();
  run_ranks(2,
            [](int) {
              ::setenv("DTENSOR_BACKEND", "infiniband", 1);
              const std::string msg =
                  dtensor::testing::message_of([] { comm::init_process_group(); });
              EXPECT_CONTAINS(msg, "unknown backend 'infiniband' in DTENSOR_BACKEND");
              EXPECT_CONTAINS(msg, "expected gloo, mpi, nccl or auto");
            },
            {.init_process_group = false});
}

TEST(BackendSelection, InitOptionsChooseTheEngineAndTheEnvironmentOverridesThem) {
  SKIP_IN_MPI_JOB();
  run_ranks(2,
            [](int) {
              ::unsetenv("DTENSOR_BACKEND");
              const std::string msg = dtensor::testing::message_of(
                  [] { comm::init_process_group({.backend = "infiniband"}); });
              EXPECT_CONTAINS(msg, "unknown backend 'infiniband' in InitOptions::backend");
              comm::init_process_group({.backend = "Gloo"});
              EXPECT_EQ(comm::cpu_backend_name(), "gloo");
              comm::destroy_process_group();
              // The environment wins, as DTENSOR_TIMEOUT_S does over InitOptions::timeout.
              ::setenv("DTENSOR_BACKEND", "gloo", 1);
              comm::init_process_group({.backend = "infiniband"});
              EXPECT_EQ(comm::cpu_backend_name(), "gloo");
              comm::destroy_process_group();
              ::unsetenv("DTENSOR_BACKEND");
            },
            {.init_process_group = false});
}

TEST(BackendSelection, AutoPicksGlooForForkedRanksAndTheEnvironmentChooses) {
  SKIP_IN_MPI_JOB();
  run_ranks(2,
            [](int) {
              ::unsetenv("DTENSOR_BACKEND");
              comm::init_process_group();
              EXPECT_EQ(comm::cpu_backend_name(), "gloo");  // no mpirun: Gloo
              EXPECT_EQ(comm::world_group()->backend(c10::DeviceType::CPU).getBackendName(),
                        "gloo");
              comm::destroy_process_group();
              ::setenv("DTENSOR_BACKEND", "NCCL", 1);  // CUDA tensors only: CPU ones stay on Gloo
              comm::init_process_group();
              EXPECT_EQ(comm::cpu_backend_name(), "gloo");
              comm::destroy_process_group();
              if (!comm::has_mpi()) {
                ::setenv("DTENSOR_BACKEND", "mpi", 1);
                EXPECT_CONTAINS(dtensor::testing::message_of([] { comm::init_process_group(); }),
                                "this build has none");
              }
            },
            {.init_process_group = false});
}

TEST(BackendSelection, MpiForRanksThatMpirunDidNotStartNamesBothRankings) {
  SKIP_IN_MPI_JOB();
  if (!comm::has_mpi()) GTEST_SKIP() << "this build has no MPI";
  // Each forked rank is an MPI singleton (rank 0 of 1): the backend refuses the mismatch.
  run_ranks(2,
            [](int rank) {
              ::setenv("DTENSOR_BACKEND", "mpi", 1);
              comm::init_process_group();
              EXPECT_EQ(comm::cpu_backend_name(), "mpi");
              if (rank == 0) return;
              const std::string msg = dtensor::testing::message_of(
                  [&] { comm::world_group()->backend(c10::DeviceType::CPU); });
              EXPECT_CONTAINS(msg, "MPI says this process is rank 0 of 1");
              EXPECT_CONTAINS(msg, "says rank 1 of 2");
              EXPECT_CONTAINS(msg, "mpirun -np N");
            },
            {.init_process_group = false});
}

TEST(MpiBackend, AutoSelectsMpiUnderMpirun) {
  if (!dtensor::testing::in_mpi_job()) GTEST_SKIP() << "runs as ranks of an mpirun job";
  run_ranks(2,
            [](int) {
              ::unsetenv("DTENSOR_BACKEND");
              comm::init_process_group();
              EXPECT_EQ(comm::cpu_backend_name(), "mpi");
              EXPECT_EQ(comm::world_group()->backend(c10::DeviceType::CPU).getBackendName(), "mpi");
            },
            {.init_process_group = false});
}

TEST(MpiBackend, EveryC10dOperationMatchesLocalComputation) {
  if (!dtensor::testing::in_mpi_job()) GTEST_SKIP() << "runs as ranks of an mpirun job";
  run_ranks(2, [](int rank) {
    auto& pg = *comm::world_group();
    ASSERT_EQ(comm::cpu_backend_name(), "mpi");
    c10d::Backend& b = pg.backend(c10::DeviceType::CPU);
    ASSERT_EQ(b.getBackendName(), "mpi");
    const double other = 1 - rank;

    // allreduce: every op the library maps to, on float, integer and half types.
    for (auto dtype : {at::kFloat, at::kDouble, at::kInt, at::kLong, at::kHalf, at::kBFloat16}) {
      auto mine = seq(5, dtype, rank), theirs = seq(5, dtype, other);
      const std::pair<c10d::ReduceOp::RedOpType, at::Tensor> cases[] = {
          {c10d::ReduceOp::SUM, mine + theirs},
          {c10d::ReduceOp::MAX, at::maximum(mine, theirs)},
          {c10d::ReduceOp::MIN, at::minimum(mine, theirs)},
          {c10d::ReduceOp::PRODUCT, mine * theirs}};
      for (const auto& [op, want] : cases) {
        std::vector<at::Tensor> v{mine.clone()};
        c10d::AllreduceOptions o;
        o.reduceOp = c10d::ReduceOp(op);
        expect_done(b.allreduce(v, o));
        EXPECT_TENSOR_EQ(v[0], want);
      }
    }
    {
      std::vector<at::Tensor> v{seq(4, at::kDouble, rank)};
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::AVG);
      expect_done(b.allreduce(v, o));
      EXPECT_TENSOR_EQ(v[0], seq(4, at::kDouble, 0.5));
      std::vector<at::Tensor> flags{at::tensor({rank == 0 ? 1 : 0, 0, 1}).to(at::kBool)};
      expect_done(b.allreduce(flags));  // SUM of bools: logical or
      EXPECT_TRUE(at::equal(flags[0], at::tensor({1, 0, 1}).to(at::kBool))) << flags[0];
    }
    // allreduce_coalesced: mixed dtypes, each reduced as one flat buffer.
    {
      std::vector<at::Tensor> v{seq(3, at::kFloat, rank), seq(2, at::kLong, rank),
                                seq(4, at::kFloat, 10 * rank).view({2, 2})};
      expect_done(b.allreduce_coalesced(v));
      EXPECT_TENSOR_EQ(v[0], seq(3, at::kFloat) * 2 + 1);
      EXPECT_TENSOR_EQ(v[1], seq(2, at::kLong) * 2 + 1);
      EXPECT_TENSOR_EQ(v[2], (seq(4, at::kFloat) * 2 + 10).view({2, 2}));
    }
    // allgather with uneven sizes: rank r contributes r + 2 values.
    {
      std::vector<at::Tensor> in{at::full({rank + 2}, rank + 1.0)};
      std::vector<std::vector<at::Tensor>> out{{at::empty({2}), at::empty({3})}};
      expect_done(b.allgather(out, in));
      EXPECT_TENSOR_EQ(out[0][0], at::full({2}, 1.0));
      EXPECT_TENSOR_EQ(out[0][1], at::full({3}, 2.0));
    }
    // Flat and coalesced all-gather into one tensor.
    {
      at::Tensor in = seq(3, at::kFloat, 3 * rank), out = at::empty({6});
      expect_done(b._allgather_base(out, in));
      EXPECT_TENSOR_EQ(out, seq(6, at::kFloat));
      std::vector<at::Tensor> ins{seq(2, at::kDouble, rank), at::full({1}, rank, at::kLong)};
      std::vector<at::Tensor> outs{at::empty({4}, at::kDouble), at::empty({2}, at::kLong)};
      expect_done(b.allgather_into_tensor_coalesced(outs, ins));
      EXPECT_TENSOR_EQ(outs[0], at::tensor({0.0, 1.0, 1.0, 2.0}, at::kDouble));
      EXPECT_TENSOR_EQ(outs[1], at::tensor({0, 1}, at::kLong));
    }
    // Reduce-scatter: flat, coalesced, and by lists with uneven chunks.
    {
      at::Tensor in = seq(6, at::kFloat, rank), out = at::empty({3});
      expect_done(b._reduce_scatter_base(out, in));
      EXPECT_TENSOR_EQ(out, (seq(6, at::kFloat) * 2 + 1).chunk(2)[rank]);
      std::vector<at::Tensor> ins{seq(4, at::kDouble, rank), seq(2, at::kInt, rank)};
      std::vector<at::Tensor> outs{at::empty({2}, at::kDouble), at::empty({1}, at::kInt)};
      c10d::ReduceScatterOptions o;
      o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
      expect_done(b.reduce_scatter_tensor_coalesced(outs, ins, o));
      EXPECT_TENSOR_EQ(outs[0], seq(4, at::kDouble, 1).chunk(2)[rank]);
      EXPECT_TENSOR_EQ(outs[1], seq(2, at::kInt, 1).chunk(2)[rank]);
      std::vector<std::vector<at::Tensor>> lists{
          {seq(1, at::kFloat, rank), seq(2, at::kFloat, rank)}};
      std::vector<at::Tensor> mine{at::empty({rank + 1})};
      expect_done(b.reduce_scatter(mine, lists));
      EXPECT_TENSOR_EQ(mine[0], seq(rank + 1, at::kFloat) * 2 + 1);
    }
    // all-to-all, even and with row splits: rank r sends r + j + 1 rows to rank j.
    {
      at::Tensor in = seq(4, at::kFloat, 10 * rank), out = at::empty({4});
      std::vector<int64_t> none;
      expect_done(b.alltoall_base(out, in, none, none));
      EXPECT_TENSOR_EQ(out,
                       at::cat({seq(2, at::kFloat, 2 * rank), seq(2, at::kFloat, 10 + 2 * rank)}));
      std::vector<int64_t> send_rows{rank + 1, rank + 2}, recv_rows{rank + 1, rank + 2};
      at::Tensor rows = at::cat({at::full({send_rows[0], 2}, 100.0 * rank),
                                 at::full({send_rows[1], 2}, 100.0 * rank + 1)});
      at::Tensor got = at::empty({recv_rows[0] + recv_rows[1], 2});
      expect_done(b.alltoall_base(got, rows, recv_rows, send_rows));
      EXPECT_TENSOR_EQ(got, at::cat({at::full({recv_rows[0], 2}, 0.0 + rank),
                                     at::full({recv_rows[1], 2}, 100.0 + rank)}));
      // Through the comm layer (expert parallelism's dispatch): bfloat16, which MPI carries as
      // bytes, still split in rows.
      EXPECT_TENSOR_EQ(
          comm::all_to_all_single(rows.to(at::kBFloat16), recv_rows, send_rows, pg).to(at::kFloat),
          got);
    }
    // broadcast, reduce, gather, scatter, barrier.
    {
      std::vector<at::Tensor> v{seq(3, at::kLong, rank)};
      c10d::BroadcastOptions bo;
      bo.rootRank = 1;
      expect_done(b.broadcast(v, bo));
      EXPECT_TENSOR_EQ(v[0], seq(3, at::kLong, 1));
      std::vector<at::Tensor> r{seq(3, at::kFloat, rank)};
      c10d::ReduceOptions ro;
      ro.rootRank = 0;
      expect_done(b.reduce(r, ro));
      if (rank == 0) {
        EXPECT_TENSOR_EQ(r[0], seq(3, at::kFloat) * 2 + 1);
      }
      std::vector<at::Tensor> gin{at::full({2}, rank + 5.0)};
      std::vector<std::vector<at::Tensor>> gout;
      if (rank == 1) gout.push_back({at::empty({2}), at::empty({2})});
      c10d::GatherOptions go;
      go.rootRank = 1;
      expect_done(b.gather(gout, gin, go));
      if (rank == 1) {
        EXPECT_TENSOR_EQ(at::cat(gout[0]), at::tensor({5.f, 5.f, 6.f, 6.f}));
      }
      std::vector<at::Tensor> sout{at::empty({2})};
      std::vector<std::vector<at::Tensor>> sin;
      if (rank == 0) sin.push_back({at::full({2}, 7.0), at::full({2}, 8.0)});
      expect_done(b.scatter(sout, sin));
      EXPECT_TENSOR_EQ(sout[0], at::full({2}, 7.0 + rank));
      expect_done(b.barrier());
    }
    // send/recv, both ranks sending first: 4 MiB messages need the receiver, so a blocking send
    // would deadlock here; the work finishes in wait().
    {
      std::vector<at::Tensor> out{at::full({1 << 20}, rank + 1.0)}, in{at::empty({1 << 20})};
      auto s = b.send(out, 1 - rank, 7);
      auto r = b.recv(in, 1 - rank, 7);
      r->wait();
      s->wait();
      EXPECT_TRUE(r->isCompleted() && s->isCompleted());
      EXPECT_EQ(r->sourceRank(), 1 - rank);
      EXPECT_TENSOR_EQ(in[0], at::full({1 << 20}, 2.0 - rank));
      std::vector<at::Tensor> any{at::empty({1}, at::kLong)}, one{at::full({1}, rank, at::kLong)};
      auto ra = b.recvAnysource(any, 9);
      auto sa = b.send(one, 1 - rank, 9);
      ra->wait();
      sa->wait();
      EXPECT_EQ(ra->sourceRank(), 1 - rank);
      EXPECT_EQ(any[0].item<int64_t>(), 1 - rank);
    }
    // A finished collective's future holds its outputs; bad arguments are named.
    {
      std::vector<at::Tensor> v{at::ones({2})};
      auto w = b.allreduce(v);
      auto f = w->getFuture();
      EXPECT_TRUE(f->completed());
      EXPECT_TENSOR_EQ(f->value().toTensorList()[0], at::full({2}, 2.0));
      std::vector<at::Tensor> strided{at::ones({4, 2}).t()};
      EXPECT_CONTAINS(dtensor::testing::message_of([&] { b.allreduce(strided); }),
                      "allreduce needs dense contiguous tensors");
    }
  });
}

// A job that stops or kills a rank inside an all_reduce; MpiFaults below starts it.
TEST(MpiFaultJob, RankStopsOrDiesInsideAllReduce) {
  const char* fault = std::getenv("DTENSOR_MPI_FAULT");
  if (!fault || !dtensor::testing::in_mpi_job()) GTEST_SKIP() << "started by MpiFaults";
  run_ranks(2,
            [&](int rank) {
              auto& g = *comm::world_group();
              comm::all_reduce(at::ones({1024}), ReduceOp::Sum, g);  // connected
              if (rank == 1) ::raise(std::string(fault) == "kill" ? SIGKILL : SIGSTOP);
              comm::all_reduce(at::ones({1024}), ReduceOp::Sum, g);
              ADD_FAILURE() << "rank " << rank << " finished an all_reduce without its peer";
            },
            {.comm_timeout = std::chrono::seconds(4)});
}

// A job whose rank 1 outlives rank 0, the rank hosting the store, by half a second: with or
// without destroy_process_group. MpiExit below starts it.
TEST(MpiExitJob, Rank1FinishesAfterTheStoreHost) {
  const char* how = std::getenv("DTENSOR_EXIT_JOB");
  if (!how || !dtensor::testing::in_mpi_job()) GTEST_SKIP() << "started by MpiExit";
  comm::init_process_group();  // rank 0 hosts the store: no test harness, no launcher store
  comm::all_reduce(at::ones({4}), ReduceOp::Sum, *comm::world_group());
  if (comm::get_rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  if (std::string(how) == "destroy") comm::destroy_process_group();
}

namespace {

struct JobResult {
  int status = -1;
  double seconds = 0;
  std::string output;
};

// Runs this executable's test `filter` as a 2-rank mpirun job with `env` set, output (both
// streams) captured.
JobResult run_job(const std::string& env, const std::string& filter) {
  const auto t0 = std::chrono::steady_clock::now();
  char self[4096] = {0};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return {};
  const std::string cmd = env +
                          " DTENSOR_BACKEND=mpi OMP_NUM_THREADS=1 timeout -s KILL 60 " MPIEXEC_PATH
                          " --allow-run-as-root --oversubscribe -np 2 " +
                          std::string(self) + " --gtest_color=no --gtest_filter=" + filter +
                          " 2>&1";
  JobResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, got);
  r.status = ::pclose(p);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

JobResult run_fault_job(const std::string& fault) {
  return run_job("DTENSOR_MPI_FAULT=" + fault, "MpiFaultJob.RankStopsOrDiesInsideAllReduce");
}

}  // namespace

TEST(MpiFaults, StoppedRankEndsTheJobWithinTheTimeoutNamingRankAndCollective) {
  SKIP_IN_MPI_JOB();
  if (!comm::has_mpi()) GTEST_SKIP() << "this build has no MPI";
  const JobResult r = run_fault_job("stop");
  EXPECT_NE(r.status, 0) << r.output;
  // Timeout 4 s; starting and stopping mpirun takes up to a few seconds more on a busy machine.
  // Without the guard the job would hang until `timeout` kills it at 60 s.
  EXPECT_LT(r.seconds, 4.0 + 6.0) << r.output;
  EXPECT_CONTAINS(r.output, "dtensor: rank 0: all_reduce float32[1024]");
  EXPECT_CONTAINS(r.output, "as collective #2 on group world");
  EXPECT_CONTAINS(r.output, "did not complete within 4");
  EXPECT_CONTAINS(r.output, "rank 1 did not answer");
  EXPECT_CONTAINS(r.output, "an MPI call cannot be cancelled");
}

TEST(MpiFaults, KilledRankEndsTheJobNamingRankAndCollective) {
  SKIP_IN_MPI_JOB();
  if (!comm::has_mpi()) GTEST_SKIP() << "this build has no MPI";
  const JobResult r = run_fault_job("kill");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_LT(r.seconds, 4.0 + 6.0) << r.output;
  EXPECT_CONTAINS(r.output, "noticed that process rank 1");
  EXPECT_CONTAINS(r.output, "dtensor: rank 0: all_reduce float32[1024]");
  EXPECT_CONTAINS(r.output, "was ended by the launcher (SIGTERM) inside the MPI call");
}

// The rank hosting the store waits at its exit until every rank has left, so that no rank's
// watchdog finds the store gone (TCPStore then logs a warning with a stack trace).
TEST(MpiExit, ARankFinishingAfterTheStoreHostExitsQuietly) {
  SKIP_IN_MPI_JOB();
  if (!comm::has_mpi()) GTEST_SKIP() << "this build has no MPI";
  for (const std::string how : {"destroy", "exit"}) {
    const int port = dtensor::launch::free_port();
    const JobResult r = run_job(
        "DTENSOR_EXIT_JOB=" + how + " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port),
        "MpiExitJob.Rank1FinishesAfterTheStoreHost");
    EXPECT_EQ(r.status, 0) << how << ":\n" << r.output;
    EXPECT_CONTAINS(r.output, "[  PASSED  ] 1 test");
    EXPECT_EQ(r.output.find("TCPStore"), std::string::npos) << how << ":\n" << r.output;
  }
}
