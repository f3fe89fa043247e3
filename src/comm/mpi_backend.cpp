// c10d backend on MPI for CPU tensors; the one translation unit that sees mpi.h (compiled with
// DTENSOR_WITH_MPI only when CMake found an MPI C library, see cmake/Mpi.cmake).
//
// Collectives run eagerly on the calling thread as blocking MPI calls: Open MPI's blocking
// collectives over shared memory take a few microseconds, where a hand-off to a worker thread
// or the non-blocking variants cost more than the call itself on a small machine. A blocking
// MPI call can neither time out nor be cancelled, so collectives.cpp runs each one inside a
// detail::BlockingSection: past the timeout, or when another rank fails, the health layer
// names the rank and the collective on stderr and ends the process. Send and receive are
// posted non-blocking (a pipeline's send-then-receive must not deadlock) and finish in wait().
#include "backends.h"
#include "dtensor/comm/backend.h"
#include "dtensor/comm/process_group.h"

#ifdef DTENSOR_WITH_MPI
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <tuple>
#include <utility>

#include "health.h"
#endif

namespace dtensor::comm {

bool has_mpi() {
#ifdef DTENSOR_WITH_MPI
  return true;
#else
  return false;
#endif
}

namespace detail {

#ifndef DTENSOR_WITH_MPI

c10::intrusive_ptr<c10d::Backend> make_mpi_backend(const std::vector<int>&, int,
                                                   const std::string&) {
  return {};
}

#else

namespace {

void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  TORCH_CHECK(false, call, " failed: ", std::string(text, len));
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // After an abandoned collective a peer may never reach MPI_Finalize: leave without it.
  if (!finalized && !health_poisoned()) MPI_Finalize();
}

// Joins the MPI job once per process; the collectives need MPI_THREAD_MULTIPLE because each
// group's work may be waited on from any thread.
void ensure_mpi() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided),
                "MPI_Init_thread");
      TORCH_CHECK(provided >= MPI_THREAD_MULTIPLE, "dtensor: the MPI library grants thread level ",
                  provided,
                  " but the MPI backend needs MPI_THREAD_MULTIPLE; use an MPI built with thread "
                  "support (Debian's Open MPI is) or DTENSOR_BACKEND=gloo");
      std::atexit(finalize_at_exit);
    }
  });
}

size_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

int count_of(size_t n, const char* what) {
  TORCH_CHECK(n <= static_cast<size_t>(INT_MAX), "dtensor: MPI backend: ", what, " of ", n,
              " bytes exceeds MPI's int count (2 GiB); split the tensor into smaller pieces");
  return static_cast<int>(n);
}

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), "dtensor: MPI backend: ", op, " got a ", t.device(),
              " tensor; it handles CPU tensors only (CUDA tensors use NCCL)");
  TORCH_CHECK(t.is_contiguous() && t.layout() == c10::kStrided, "dtensor: MPI backend: ", op,
              " needs dense contiguous tensors (call .contiguous() first)");
}

const at::Tensor& single(const std::vector<at::Tensor>& v, const char* op) {
  TORCH_CHECK(v.size() == 1, "dtensor: MPI backend: ", op, " takes exactly one tensor, got ",
              v.size());
  check_tensor(v[0], op);
  return v[0];
}

// MPI has no half-precision types: such tensors are reduced in float32.
bool reduces_in_float(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

MPI_Datatype mpi_type(c10::ScalarType s, const char* op) {
  static const std::pair<c10::ScalarType, MPI_Datatype> kTypes[] = {
      {at::kFloat, MPI_FLOAT},
      {at::kDouble, MPI_DOUBLE},
      {at::kChar, MPI_INT8_T},
      {at::kByte, MPI_UINT8_T},
      {at::kShort, MPI_INT16_T},
      {at::kInt, MPI_INT32_T},
      {at::kLong, MPI_INT64_T},
      {at::kBool, MPI_C_BOOL},
      {at::kComplexFloat, MPI_C_FLOAT_COMPLEX},
      {at::kComplexDouble, MPI_C_DOUBLE_COMPLEX}};
  for (const auto& [dtype, type] : kTypes) {
    if (dtype == s) return type;
  }
  TORCH_CHECK(false, "dtensor: MPI backend: ", op, " cannot reduce ", c10::toString(s),
              " tensors; convert them to a supported dtype (float, double, integer, bool)");
}

MPI_Op mpi_op(const c10d::ReduceOp& op, c10::ScalarType s, const char* name) {
  // (c10d op, MPI op, MPI op for bools: MPI reduces C bools only with logical operators). AVG is
  // summed, then divided by the group size.
  static const std::tuple<c10d::ReduceOp::RedOpType, MPI_Op, MPI_Op> kOps[] = {
      {c10d::ReduceOp::SUM, MPI_SUM, MPI_LOR},       {c10d::ReduceOp::AVG, MPI_SUM, MPI_LOR},
      {c10d::ReduceOp::PRODUCT, MPI_PROD, MPI_LAND}, {c10d::ReduceOp::MIN, MPI_MIN, MPI_LAND},
      {c10d::ReduceOp::MAX, MPI_MAX, MPI_LOR},       {c10d::ReduceOp::BAND, MPI_BAND, MPI_LAND},
      {c10d::ReduceOp::BOR, MPI_BOR, MPI_LOR},       {c10d::ReduceOp::BXOR, MPI_BXOR, MPI_LXOR}};
  for (const auto& [type, arithmetic, logical] : kOps) {
    if (type == op.op_) return s == at::kBool ? logical : arithmetic;
  }
  TORCH_CHECK(false, "dtensor: MPI backend: ", name, " does not support reduce op ",
              static_cast<int>(op.op_), " (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR are)");
}

// A collective that already ran (outputs final, or the error it raised), or point-to-point
// requests that finish in wait().
class MpiWork : public c10d::Work {
 public:
  MpiWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::exception_ptr error)
      : c10d::Work(rank, type), outputs_(std::move(outputs)) {
    completed_ = true;
    exception_ = std::move(error);
  }
  MpiWork(int rank, c10d::OpType type, std::vector<at::Tensor> tensors, MPI_Request request,
          std::function<void()> then)
      : c10d::Work(rank, type),
        outputs_(std::move(tensors)),
        request_(request),
        then_(std::move(then)) {}

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return true;
    int done = 0;
    MPI_Status status;
    settle(MPI_Test(&request_, &done, &status), "MPI_Test", done, status);
    return completed_;
  }

  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ && !exception_;
  }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return exception_;
  }

  int sourceRank() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(completed_ && source_ >= 0,
                "dtensor: MPI backend: sourceRank() is known only after a completed receive");
    return source_;
  }

  std::vector<at::Tensor> result() override { return outputs_; }

  bool wait(
      std::chrono::milliseconds /*timeout: MPI cannot cancel; see BlockingSection*/) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!completed_) {
      MPI_Status status;
      settle(MPI_Wait(&request_, &status), "MPI_Wait", 1, status);
    }
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }

  // A future for collectives, which complete before they are returned. Point-to-point work
  // has none: wait() makes its progress.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(request_ == MPI_REQUEST_NULL || completed_,
                "dtensor: MPI backend: send/recv work has no future; call wait()");
    if (!future_) {
      future_ =
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      if (exception_) {
        future_->setError(exception_);
      } else {
        future_->markCompleted(c10::IValue(outputs_));
      }
    }
    return future_;
  }

 private:
  void settle(int rc, const char* call, int done, const MPI_Status& status) {
    if (rc != MPI_SUCCESS) {
      try {
        check_mpi(rc, call);
      } catch (...) {
        exception_ = std::current_exception();
      }
      completed_ = true;
      return;
    }
    if (!done) return;
    source_ = status.MPI_SOURCE;
    completed_ = true;
    if (then_) {
      try {
        then_();
      } catch (...) {
        exception_ = std::current_exception();
      }
    }
  }

  mutable std::mutex mutex_;
  std::vector<at::Tensor> outputs_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  std::function<void()> then_;
  int source_ = -1;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class MpiBackend : public c10d::Backend {
 public:
  MpiBackend(MPI_Comm comm, int rank, int size) : c10d::Backend(rank, size), comm_(comm) {}

  ~MpiBackend() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !health_poisoned()) MPI_Comm_free(&comm_);
  }

  const std::string getBackendName() const override { return "mpi"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const at::Tensor& t = single(tensors, "broadcast");
    return run(c10d::OpType::BROADCAST, tensors, [&] {
      check_mpi(MPI_Bcast(t.data_ptr(), count_of(nbytes(t), "broadcast"), MPI_BYTE,
                          static_cast<int>(opts.rootRank), comm_),
                "MPI_Bcast");
    });
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const at::Tensor& t = single(tensors, "allreduce");
    return run(c10d::OpType::ALLREDUCE, tensors,
               [&] { reduce_in_place(t, opts.reduceOp, "allreduce", -1); });
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    for (const auto& t : tensors) check_tensor(t, "allreduce_coalesced");
    return run(c10d::OpType::ALLREDUCE_COALESCED, tensors, [&] {
      // One call per dtype: tensors of the same dtype travel as one flat buffer.
      std::vector<bool> done(tensors.size(), false);
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (done[i]) continue;
        std::vector<at::Tensor> flat;
        std::vector<size_t> members;
        for (size_t j = i; j < tensors.size(); ++j) {
          if (tensors[j].scalar_type() != tensors[i].scalar_type()) continue;
          flat.push_back(tensors[j].view({-1}));
          members.push_back(j);
          done[j] = true;
        }
        at::Tensor buf = at::cat(flat);
        reduce_in_place(buf, opts.reduceOp, "allreduce_coalesced", -1);
        int64_t off = 0;
        for (size_t j : members) {
          const int64_t n = tensors[j].numel();
          tensors[j].view({-1}).copy_(buf.narrow(0, off, n));
          off += n;
        }
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    const at::Tensor& t = single(tensors, "reduce");
    return run(c10d::OpType::REDUCE, tensors, [&] {
      reduce_in_place(t, opts.reduceOp, "reduce", static_cast<int>(opts.rootRank));
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor> >& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    const at::Tensor& in = single(inputs, "allgather");
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                "dtensor: MPI backend: allgather needs one list of ", size_, " output tensors");
    auto& outs = outputs[0];
    return run(c10d::OpType::ALLGATHER, outs, [&] {
      // Sizes may differ per rank (uneven shards): gather bytes with per-rank counts.
      std::vector<int> counts(size_), displs(size_);
      size_t total = 0;
      for (int r = 0; r < size_; ++r) {
        check_tensor(outs[r], "allgather");
        TORCH_CHECK(outs[r].scalar_type() == in.scalar_type(),
                    "dtensor: MPI backend: allgather output ", r, " has dtype ",
                    outs[r].scalar_type(), " but the input has ", in.scalar_type());
        counts[r] = count_of(nbytes(outs[r]), "allgather output");
        displs[r] = count_of(total, "allgather");
        total += nbytes(outs[r]);
      }
      TORCH_CHECK(nbytes(in) == static_cast<size_t>(counts[rank_]),
                  "dtensor: MPI backend: allgather input has ", nbytes(in),
                  " bytes but this rank's output slot has ", counts[rank_]);
      at::Tensor flat = at::empty({static_cast<int64_t>(total)}, in.options().dtype(at::kByte));
      check_mpi(MPI_Allgatherv(in.data_ptr(), counts[rank_], MPI_BYTE, flat.data_ptr(),
                               counts.data(), displs.data(), MPI_BYTE, comm_),
                "MPI_Allgatherv");
      for (int r = 0; r < size_; ++r) {
        outs[r].view({-1}).view(at::kByte).copy_(flat.narrow(0, displs[r], counts[r]));
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions&) override {
    std::vector<at::Tensor> outs{out}, ins{in};
    return allgather_into_tensor_coalesced(outs, ins, {});
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions&) override {
    check_pairs(outputs, inputs, "allgather_into_tensor");
    return run(c10d::OpType::_ALLGATHER_BASE, outputs, [&] {
      for (size_t i = 0; i < inputs.size(); ++i) {
        TORCH_CHECK(nbytes(outputs[i]) == nbytes(inputs[i]) * size_,
                    "dtensor: MPI backend: allgather_into_tensor output has ", outputs[i].numel(),
                    " elements, expected ", size_, " x ", inputs[i].numel());
        const int n = count_of(nbytes(inputs[i]), "allgather_into_tensor input");
        check_mpi(MPI_Allgather(inputs[i].data_ptr(), n, MPI_BYTE, outputs[i].data_ptr(), n,
                                MPI_BYTE, comm_),
                  "MPI_Allgather");
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor> >& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    const at::Tensor& in = single(inputs, "gather");
    const int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> outs = rank_ == root ? outputs.at(0) : std::vector<at::Tensor>{};
    return run(c10d::OpType::GATHER, outs, [&] {
      const int n = count_of(nbytes(in), "gather");
      at::Tensor flat;
      if (rank_ == root) {
        TORCH_CHECK(static_cast<int>(outs.size()) == size_, "dtensor: MPI backend: gather needs ",
                    size_, " outputs on the root");
        flat = at::empty({static_cast<int64_t>(n) * size_}, in.options().dtype(at::kByte));
      }
      check_mpi(MPI_Gather(in.data_ptr(), n, MPI_BYTE, flat.defined() ? flat.data_ptr() : nullptr,
                           n, MPI_BYTE, root, comm_),
                "MPI_Gather");
      for (size_t r = 0; r < outs.size(); ++r) {
        outs[r].view({-1}).view(at::kByte).copy_(flat.narrow(0, r * n, n));
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor> >& inputs,
                                         const c10d::ScatterOptions& opts) override {
    const at::Tensor& out = single(outputs, "scatter");
    const int root = static_cast<int>(opts.rootRank);
    return run(c10d::OpType::SCATTER, outputs, [&] {
      const int n = count_of(nbytes(out), "scatter");
      at::Tensor flat;
      if (rank_ == root) {
        TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                    "dtensor: MPI backend: scatter needs ", size_, " inputs on the root");
        std::vector<at::Tensor> bytes;
        for (const auto& t : inputs[0]) bytes.push_back(t.contiguous().view({-1}).view(at::kByte));
        flat = at::cat(bytes);
      }
      check_mpi(MPI_Scatter(flat.defined() ? flat.data_ptr() : nullptr, n, MPI_BYTE, out.data_ptr(),
                            n, MPI_BYTE, root, comm_),
                "MPI_Scatter");
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor> >& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const at::Tensor& out = single(outputs, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                "dtensor: MPI backend: reduce_scatter needs one list of ", size_, " inputs");
    return run(c10d::OpType::REDUCE_SCATTER, outputs, [&] {
      std::vector<at::Tensor> flat;
      std::vector<int> counts;
      for (const auto& t : inputs[0]) {
        flat.push_back(t.contiguous().view({-1}));
        counts.push_back(count_of(t.numel(), "reduce_scatter input"));
      }
      TORCH_CHECK(counts[rank_] == out.numel(), "dtensor: MPI backend: reduce_scatter output has ",
                  out.numel(), " elements but this rank's input chunk has ", counts[rank_]);
      reduce_scatter_into(at::cat(flat), out, counts, opts.reduceOp);
    });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> outs{out}, ins{in};
    return reduce_scatter_tensor_coalesced(outs, ins, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    check_pairs(outputs, inputs, "reduce_scatter_tensor");
    return run(c10d::OpType::_REDUCE_SCATTER_BASE, outputs, [&] {
      for (size_t i = 0; i < inputs.size(); ++i) {
        TORCH_CHECK(inputs[i].numel() == outputs[i].numel() * size_,
                    "dtensor: MPI backend: reduce_scatter_tensor input has ", inputs[i].numel(),
                    " elements, expected ", size_, " x ", outputs[i].numel());
        std::vector<int> counts(size_, count_of(outputs[i].numel(), "reduce_scatter_tensor"));
        reduce_scatter_into(inputs[i], outputs[i], counts, opts.reduceOp);
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions&) override {
    check_tensor(out, "alltoall_base");
    check_tensor(in, "alltoall_base");
    std::vector<at::Tensor> outs{out};
    return run(c10d::OpType::ALLTOALL_BASE, outs, [&] {
      if (out_splits.empty() && in_splits.empty()) {
        TORCH_CHECK(nbytes(in) % size_ == 0 && nbytes(in) == nbytes(out),
                    "dtensor: MPI backend: alltoall_base needs equal input and output sizes "
                    "divisible by the group size ",
                    size_);
        const int n = count_of(nbytes(in) / size_, "alltoall_base chunk");
        check_mpi(MPI_Alltoall(in.data_ptr(), n, MPI_BYTE, out.data_ptr(), n, MPI_BYTE, comm_),
                  "MPI_Alltoall");
        return;
      }
      // Splits count rows along dim 0.
      auto layout = [&](const at::Tensor& t, std::vector<int64_t> splits, const char* which) {
        if (splits.empty()) splits.assign(size_, t.size(0) / size_);
        TORCH_CHECK(static_cast<int>(splits.size()) == size_, "dtensor: MPI backend: alltoall ",
                    which, " splits need ", size_, " entries, got ", splits.size());
        const size_t row = t.size(0) ? nbytes(t) / t.size(0) : 0;
        std::vector<int> counts(size_), displs(size_);
        size_t off = 0;
        for (int r = 0; r < size_; ++r) {
          counts[r] = count_of(splits[r] * row, "alltoall chunk");
          displs[r] = count_of(off, "alltoall");
          off += splits[r] * row;
        }
        return std::make_pair(counts, displs);
      };
      auto [sc, sd] = layout(in, in_splits, "input");
      auto [rc, rd] = layout(out, out_splits, "output");
      check_mpi(MPI_Alltoallv(in.data_ptr(), sc.data(), sd.data(), MPI_BYTE, out.data_ptr(),
                              rc.data(), rd.data(), MPI_BYTE, comm_),
                "MPI_Alltoallv");
    });
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override {
    TORCH_CHECK(
        static_cast<int>(outputs.size()) == size_ && static_cast<int>(inputs.size()) == size_,
        "dtensor: MPI backend: alltoall needs ", size_, " inputs and outputs");
    return run(c10d::OpType::ALLTOALL, outputs, [&] {
      std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
      std::vector<at::Tensor> in_bytes;
      size_t soff = 0, roff = 0;
      for (int r = 0; r < size_; ++r) {
        in_bytes.push_back(inputs[r].contiguous().view({-1}).view(at::kByte));
        sc[r] = count_of(nbytes(inputs[r]), "alltoall input");
        sd[r] = count_of(soff, "alltoall");
        soff += nbytes(inputs[r]);
        rc[r] = count_of(nbytes(outputs[r]), "alltoall output");
        rd[r] = count_of(roff, "alltoall");
        roff += nbytes(outputs[r]);
      }
      at::Tensor send = at::cat(in_bytes);
      at::Tensor recv = at::empty({static_cast<int64_t>(roff)}, send.options());
      check_mpi(MPI_Alltoallv(send.data_ptr(), sc.data(), sd.data(), MPI_BYTE, recv.data_ptr(),
                              rc.data(), rd.data(), MPI_BYTE, comm_),
                "MPI_Alltoallv");
      for (int r = 0; r < size_; ++r) {
        outputs[r].view({-1}).view(at::kByte).copy_(recv.narrow(0, rd[r], rc[r]));
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return run(c10d::OpType::BARRIER, {}, [&] { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); });
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    const at::Tensor& t = single(tensors, "send");
    MPI_Request req;
    check_mpi(MPI_Isend(t.data_ptr(), count_of(nbytes(t), "send"), MPI_BYTE, dst, tag, comm_, &req),
              "MPI_Isend");
    return c10::make_intrusive<MpiWork>(rank_, c10d::OpType::SEND, tensors, req, nullptr);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return post_recv(tensors, src, tag, c10d::OpType::RECV);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return post_recv(tensors, MPI_ANY_SOURCE, tag, c10d::OpType::RECVANYSOURCE);
  }

 private:
  // Runs a blocking collective now; MPI errors become the work's exception so that the caller
  // sees them where it waits (with the health layer's diagnosis), argument errors throw here.
  c10::intrusive_ptr<c10d::Work> run(c10d::OpType type, std::vector<at::Tensor> outputs,
                                     const std::function<void()>& body) {
    std::exception_ptr error;
    try {
      body();
    } catch (const c10::Error& e) {
      if (std::string(e.what_without_backtrace()).rfind("MPI_", 0) != 0) throw;
      error = std::current_exception();
    }
    return c10::make_intrusive<MpiWork>(rank_, type, std::move(outputs), std::move(error));
  }

  // In place on every rank (root < 0) or into the root's tensor.
  void reduce_in_place(const at::Tensor& t, const c10d::ReduceOp& op, const char* name, int root) {
    if (reduces_in_float(t)) {
      at::Tensor f = t.to(at::kFloat);
      reduce_in_place(f, op, name, root);
      if (root < 0 || root == rank_) t.copy_(f);
      return;
    }
    const MPI_Datatype type = mpi_type(t.scalar_type(), name);
    const MPI_Op mop = mpi_op(op, t.scalar_type(), name);
    const int n = count_of(t.numel(), name);
    if (root < 0) {
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), n, type, mop, comm_), "MPI_Allreduce");
    } else if (root == rank_) {
      check_mpi(MPI_Reduce(MPI_IN_PLACE, t.data_ptr(), n, type, mop, root, comm_), "MPI_Reduce");
    } else {
      check_mpi(MPI_Reduce(t.data_ptr(), nullptr, n, type, mop, root, comm_), "MPI_Reduce");
    }
    if (op.op_ == c10d::ReduceOp::AVG && (root < 0 || root == rank_)) t.div_(size_);
  }

  // Open MPI picks its reduce-scatter algorithm by message size, and with more than two ranks
  // the algorithms add a float element's terms in different orders: a tensor reduce-scattered
  // in pieces (tp::matmul_reduce_scatter) would then differ in the last bits from the same
  // tensor reduce-scattered whole. Two terms add alike in either order (a + b == b + a), and
  // MIN/MAX and integers are exact.
  bool needs_fixed_order(const at::Tensor& in, const c10d::ReduceOp& op) const {
    return size_ > 2 && at::isFloatingType(in.scalar_type()) &&
           (op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::AVG ||
            op.op_ == c10d::ReduceOp::PRODUCT);
  }

  // Reduce-scatter whose every element is combined in rank order 0, 1, ..., n-1 whatever the
  // tensor's size: each rank receives all ranks' chunks for it (one all-to-all, the bytes a
  // ring reduce-scatter moves) and combines them itself.
  void reduce_scatter_in_rank_order(const at::Tensor& in, const at::Tensor& out,
                                    const std::vector<int>& counts, const c10d::ReduceOp& op) {
    const int mine = counts[rank_];
    const int64_t esize = static_cast<int64_t>(in.element_size());
    std::vector<int> send_counts(size_), send_displs(size_), recv_counts(size_, 0),
        recv_displs(size_, 0);
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      send_counts[r] = count_of(static_cast<size_t>(counts[r] * esize), "reduce_scatter chunk");
      send_displs[r] = count_of(static_cast<size_t>(offset * esize), "reduce_scatter offset");
      offset += counts[r];
      recv_counts[r] = count_of(static_cast<size_t>(mine * esize), "reduce_scatter chunk");
      recv_displs[r] =
          count_of(static_cast<size_t>(int64_t{r} * mine * esize), "reduce_scatter offset");
    }
    at::Tensor parts = at::empty({size_, mine}, in.options());
    check_mpi(
        MPI_Alltoallv(in.data_ptr(), send_counts.data(), send_displs.data(), MPI_BYTE,
                      parts.data_ptr(), recv_counts.data(), recv_displs.data(), MPI_BYTE, comm_),
        "MPI_Alltoallv");
    at::Tensor acc = out.view({-1});
    acc.copy_(parts[0]);
    for (int r = 1; r < size_; ++r) {
      if (op.op_ == c10d::ReduceOp::PRODUCT) {
        acc.mul_(parts[r]);
      } else {
        acc.add_(parts[r]);
      }
    }
  }

  // `in` holds every rank's chunk back to back (chunk r has counts[r] elements).
  void reduce_scatter_into(const at::Tensor& in, const at::Tensor& out,
                           const std::vector<int>& counts, const c10d::ReduceOp& op) {
    if (reduces_in_float(in)) {
      at::Tensor f = at::empty(out.sizes(), out.options().dtype(at::kFloat));
      reduce_scatter_into(in.to(at::kFloat), f, counts, op);
      out.copy_(f);
      return;
    }
    const MPI_Datatype type = mpi_type(in.scalar_type(), "reduce_scatter");
    const MPI_Op mop = mpi_op(op, in.scalar_type(), "reduce_scatter");
    const bool even =
        std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; });
    if (needs_fixed_order(in, op)) {
      reduce_scatter_in_rank_order(in, out, counts, op);
    } else if (even) {
      check_mpi(
          MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), counts[0], type, mop, comm_),
          "MPI_Reduce_scatter_block");
    } else {
      check_mpi(MPI_Reduce_scatter(in.data_ptr(), out.data_ptr(), counts.data(), type, mop, comm_),
                "MPI_Reduce_scatter");
    }
    if (op.op_ == c10d::ReduceOp::AVG) out.div_(size_);
  }

  void check_pairs(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                   const char* op) {
    TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(), "dtensor: MPI backend: ", op,
                " needs as many outputs as inputs, got ", outputs.size(), " and ", inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_tensor(outputs[i], op);
      check_tensor(inputs[i], op);
      TORCH_CHECK(outputs[i].scalar_type() == inputs[i].scalar_type(), "dtensor: MPI backend: ", op,
                  " output ", i, " has dtype ", outputs[i].scalar_type(), ", input has ",
                  inputs[i].scalar_type());
    }
  }

  c10::intrusive_ptr<c10d::Work> post_recv(std::vector<at::Tensor>& tensors, int src, int tag,
                                           c10d::OpType type) {
    const at::Tensor& t = single(tensors, "recv");
    MPI_Request req;
    check_mpi(MPI_Irecv(t.data_ptr(), count_of(nbytes(t), "recv"), MPI_BYTE, src, tag, comm_, &req),
              "MPI_Irecv");
    return c10::make_intrusive<MpiWork>(rank_, type, tensors, req, nullptr);
  }

  MPI_Comm comm_;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_mpi_backend(const std::vector<int>& global_ranks, int rank,
                                                   const std::string& name) {
  ensure_mpi();
  const LaunchEnv e = read_launch_env();
  int world_rank = 0, world_size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  TORCH_CHECK(world_rank == e.rank && world_size == e.world_size,
              "dtensor: the MPI backend needs the ranks MPI started: MPI says this process is "
              "rank ",
              world_rank, " of ", world_size, ", the launch environment (", e.source,
              " variables) says rank ", e.rank, " of ", e.world_size,
              "; start the job with mpirun -np N (or dtrun --backend mpi), or choose "
              "DTENSOR_BACKEND=gloo");
  MPI_Group world_group, group;
  check_mpi(MPI_Comm_group(MPI_COMM_WORLD, &world_group), "MPI_Comm_group");
  check_mpi(MPI_Group_incl(world_group, static_cast<int>(global_ranks.size()), global_ranks.data(),
                           &group),
            "MPI_Group_incl");
  // Only the members create the communicator (groups are created lazily, by their members);
  // the tag keeps creations of different groups apart.
  const int tag = static_cast<int>(std::hash<std::string>{}(name) % 32000);
  MPI_Comm comm = MPI_COMM_NULL;
  const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &comm);
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  check_mpi(rc, "MPI_Comm_create_group");
  // Errors come back as return codes (and so as exceptions naming the collective).
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int comm_rank = -1;
  MPI_Comm_rank(comm, &comm_rank);
  TORCH_CHECK(comm_rank == rank, "dtensor: MPI backend: group ", name, " rank ", rank,
              " got MPI communicator rank ", comm_rank);
  return c10::make_intrusive<MpiBackend>(comm, rank, static_cast<int>(global_ranks.size()));
}

#endif

}  // namespace detail
}  // namespace dtensor::comm
