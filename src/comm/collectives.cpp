#include "dtensor/comm/collectives.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>

#include <optional>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "backends.h"
#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/util/error_message.h"
#include "dtype_transport.h"
#include "health.h"
#include "tape.h"

namespace dtensor::comm {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:  // Gloo has no AVG: sum, then divide in finish()
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::Max:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::Min:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceOp::Product:
      return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
  }
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

std::string describe(const char* what, ProcessGroup& pg, const at::Tensor& t, int64_t seq) {
  std::string s = std::string(what) + " " + detail::signature(t) + " (" +
                  std::to_string(t.numel() * t.element_size()) + " bytes) as collective #" +
                  std::to_string(seq) + " on group " + pg.name() + " (group rank " +
                  std::to_string(pg.rank()) + " of " + std::to_string(pg.size());
  if (pg.mesh_dim() >= 0) s += ", mesh dim " + std::to_string(pg.mesh_dim());
  return s + ")";
}

void record(CommType type, const at::Tensor& t, ProcessGroup& pg) {
  CommDebugMode::record(CommRecord{type, t.numel() * static_cast<int64_t>(t.element_size()),
                                   pg.mesh_dim(), pg.size(), ModuleScope::current(),
                                   BackwardScope::active()});
}

c10d::Backend& backend_for(ProcessGroup& pg, const at::Tensor& t) {
  return pg.backend(t.device().type());
}

// Issues `issue(backend)`, wrapping errors with the collective's description.
template <typename F>
PendingResult launch(const char* name, CommType type, ProcessGroup& pg, const at::Tensor& input,
                     at::Tensor buffer, std::function<at::Tensor(at::Tensor)> finish, F&& issue) {
  record(type, input, pg);
  const int64_t seq = detail::begin_collective(pg, name, input);
  std::string what = describe(name, pg, input, seq);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    // MPI blocks here until the collective is done, with no timeout of its own.
    std::optional<detail::BlockingSection> blocking;
    if (input.device().is_cpu() && detail::cpu_collectives_block()) {
      blocking.emplace(pg, seq, "rank " + std::to_string(pg.global_rank(pg.rank())) + ": " + what);
    }
    work = issue(backend_for(pg, input));
  } catch (const std::exception& e) {
    detail::issue_failed(pg, seq, pg.name(),
                         "rank " + std::to_string(pg.global_rank(pg.rank())) + ": " + what, e);
  }
  detail::attach(work.get(), pg, seq, pg.name(), /*blocks=*/false);
  return PendingResult(std::move(work), std::move(buffer), std::move(finish),
                       "rank " + std::to_string(pg.global_rank(pg.rank())) + ": " + what);
}

// "all_gather_into_tensor dim 1 of float64[2,4,32] on group tp (2 ranks)": what a recorded
// collective must match when it is replayed.
std::string tape_key(const std::string& op, const at::Tensor& t, ProcessGroup& pg) {
  return op + " of " + detail::signature(t) + " on group " + pg.name() + " (" +
         std::to_string(pg.size()) + " ranks)";
}

PendingResult ready(at::Tensor t) { return PendingResult({}, std::move(t), nullptr, ""); }

// What follows the engine's reduction of `n` ranks' values: an average's division, then the
// result in `out` (nothing when the engine reduced `out` itself, in its dtype, by its op).
std::function<at::Tensor(at::Tensor)> finish_reduction(const detail::Reduction& how, ReduceOp op,
                                                       at::Tensor out, int64_t n) {
  const bool avg = op == ReduceOp::Avg;
  if (!avg && how.native()) return nullptr;
  return [how, out = std::move(out), n, avg](at::Tensor x) {
    if (avg) x.div_(n);
    return how.from_engine(x, out);
  };
}

}  // namespace

PendingResult::PendingResult(c10::intrusive_ptr<c10d::Work> work, at::Tensor buffer,
                             std::function<at::Tensor(at::Tensor)> finish, std::string what)
    : work_(std::move(work)),
      buffer_(std::move(buffer)),
      finish_(std::move(finish)),
      what_(std::move(what)) {}

at::Tensor PendingResult::wait() {
  if (work_) {
    auto work = std::move(work_);  // reset even when waiting throws
    detail::wait_collective(*work, what_);
    if (finish_) {
      buffer_ = finish_(std::move(buffer_));
      finish_ = nullptr;
    }
  }
  return buffer_;
}

void PendingResult::then(std::function<at::Tensor(at::Tensor)> f) {
  if (!work_) {
    buffer_ = f(std::move(buffer_));
    return;
  }
  if (!finish_) {
    finish_ = std::move(f);
    return;
  }
  finish_ = [a = std::move(finish_), b = std::move(f)](at::Tensor t) { return b(a(std::move(t))); };
}

PendingResult all_reduce_async(const at::Tensor& t, ReduceOp op, ProcessGroup& pg) {
  const detail::Reduction how(t.scalar_type(), op, "all_reduce");
  if (detail::tape_open())
    return ready(detail::taped(tape_key(std::string("all_reduce ") + reduce_op_name(op), t, pg),
                               [&] { return all_reduce_async(t, op, pg).wait(); }));
  // Out-of-place: reduce into a private copy (clone() resolves a lazy conjugate).
  at::Tensor buf = t.clone(at::MemoryFormat::Contiguous);
  const int64_t n = pg.size();
  if (n == 1) {  // the reduction of one value (an average too) is the value
    record(CommType::all_reduce, t, pg);
    return ready(buf);
  }
  at::Tensor engine = how.to_engine(buf);
  return launch("all_reduce", CommType::all_reduce, pg, t, engine,
                finish_reduction(how, op, buf, n), [&](c10d::Backend& b) {
                  std::vector<at::Tensor> v{engine};
                  c10d::AllreduceOptions o;
                  o.reduceOp = to_c10d(how.engine_op());
                  return b.allreduce(v, o);
                });
}

at::Tensor all_reduce(const at::Tensor& t, ReduceOp op, ProcessGroup& pg) {
  return all_reduce_async(t, op, pg).wait();
}

PendingResult all_gather_into_tensor_async(const at::Tensor& t, int64_t dim, ProcessGroup& pg) {
  if (detail::tape_open())
    return ready(detail::taped(tape_key("all_gather_into_tensor dim " + std::to_string(dim), t, pg),
                               [&] { return all_gather_into_tensor_async(t, dim, pg).wait(); }));
  const int64_t k = pg.size();
  dim = c10::maybe_wrap_dim(dim, t.dim());
  at::Tensor in = detail::dense(t);
  std::vector<int64_t> stacked(in.sizes().begin(), in.sizes().end());
  stacked.insert(stacked.begin(), k);
  at::Tensor out = at::empty(stacked, in.options());
  auto finish = [dim, k](at::Tensor x) {
    // (k, s0, .., sd, ..) -> (s0, .., k*sd, ..): rank-major order along `dim`.
    if (dim == 0) return x.flatten(0, 1);
    return x.movedim(0, dim).flatten(dim, dim + 1).contiguous();
  };
  if (k == 1 || in.numel() == 0) {
    record(CommType::all_gather_into_tensor, t, pg);
    return PendingResult({}, finish(out.copy_(in.unsqueeze(0).expand_as(out))), nullptr, "");
  }
  at::Tensor flat_out = detail::movable(out.view({-1}));
  at::Tensor flat_in = detail::movable(in.view({-1}));
  return launch("all_gather_into_tensor", CommType::all_gather_into_tensor, pg, t, out, finish,
                [&](c10d::Backend& b) { return b._allgather_base(flat_out, flat_in); });
}

at::Tensor all_gather_into_tensor(const at::Tensor& t, int64_t dim, ProcessGroup& pg) {
  return all_gather_into_tensor_async(t, dim, pg).wait();
}

PendingResult reduce_scatter_tensor_async(const at::Tensor& t, int64_t dim, ReduceOp op,
                                          ProcessGroup& pg) {
  const detail::Reduction how(t.scalar_type(), op, "reduce_scatter_tensor");
  if (detail::tape_open())
    return ready(detail::taped(
        tape_key("reduce_scatter_tensor dim " + std::to_string(dim) + " " + reduce_op_name(op), t,
                 pg),
        [&] { return reduce_scatter_tensor_async(t, dim, op, pg).wait(); }));
  const int64_t k = pg.size();
  dim = c10::maybe_wrap_dim(dim, t.dim());
  TORCH_CHECK(t.size(dim) % k == 0, "dtensor: reduce_scatter_tensor needs dim ", dim, " (size ",
              t.size(dim), ") divisible by the group size ", k, "; pad first");
  // Chunks laid out rank-major so chunk r is contiguous for the backend.
  at::Tensor in = dim == 0 ? detail::dense(t) : at::stack(t.chunk(k, dim), 0);
  std::vector<int64_t> out_shape(t.sizes().begin(), t.sizes().end());
  out_shape[dim] /= k;
  at::Tensor out = at::empty(out_shape, t.options());
  if (k == 1) {
    record(CommType::reduce_scatter_tensor, t, pg);
    return ready(out.copy_(t));  // an average of one value too
  }
  const ReduceOp engine_op = how.engine_op();
  if (engine_op == ReduceOp::Max || engine_op == ReduceOp::Min || engine_op == ReduceOp::Product) {
    // Gloo reduce-scatter only sums: reduce everything, keep our chunk.
    at::Tensor buf = in.clone();
    at::Tensor engine = how.to_engine(buf);
    const int64_t r = pg.rank();
    return launch(
        "reduce_scatter_tensor", CommType::reduce_scatter_tensor, pg, t, engine,
        [how, buf, dim, k, r, out_shape](at::Tensor x) {
          at::Tensor all = how.from_engine(x, buf);
          at::Tensor mine = dim == 0 ? all.chunk(k, 0)[r] : all.select(0, r);
          return mine.contiguous().view(out_shape);
        },
        [&](c10d::Backend& b) {
          std::vector<at::Tensor> v{engine};
          c10d::AllreduceOptions o;
          o.reduceOp = to_c10d(engine_op);
          return b.allreduce(v, o);
        });
  }
  at::Tensor engine_in = how.to_engine(in).reshape({-1});
  at::Tensor engine_out = how.engine_output(out);
  return launch("reduce_scatter_tensor", CommType::reduce_scatter_tensor, pg, t, engine_out,
                finish_reduction(how, op, out, k), [&](c10d::Backend& b) {
                  at::Tensor flat_out = engine_out.view({-1});
                  c10d::ReduceScatterOptions o;
                  o.reduceOp = to_c10d(engine_op);
                  return b._reduce_scatter_base(flat_out, engine_in, o);
                });
}

at::Tensor reduce_scatter_tensor(const at::Tensor& t, int64_t dim, ReduceOp op, ProcessGroup& pg) {
  return reduce_scatter_tensor_async(t, dim, op, pg).wait();
}

at::Tensor all_to_all_single(const at::Tensor& t, int64_t split_dim, int64_t concat_dim,
                             ProcessGroup& pg) {
  if (detail::tape_open())
    return detail::taped(tape_key("all_to_all_single split " + std::to_string(split_dim) +
                                      " concat " + std::to_string(concat_dim),
                                  t, pg),
                         [&] { return all_to_all_single(t, split_dim, concat_dim, pg); });
  const int64_t k = pg.size();
  split_dim = c10::maybe_wrap_dim(split_dim, t.dim());
  concat_dim = c10::maybe_wrap_dim(concat_dim, t.dim());
  TORCH_CHECK(t.size(split_dim) % k == 0, "dtensor: all_to_all_single needs dim ", split_dim,
              " divisible by the group size");
  at::Tensor in = at::stack(t.chunk(k, split_dim), 0).contiguous();  // (k, ...chunk)
  at::Tensor out = at::empty_like(in);
  auto finish = [concat_dim](at::Tensor x) {
    // received chunk j came from rank j: concatenate along concat_dim in rank order
    return x.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1).contiguous();
  };
  if (k == 1) {
    record(CommType::all_to_all_single, t, pg);
    return PendingResult({}, finish(in), nullptr, "").wait();
  }
  at::Tensor flat_out = detail::movable(out.view({-1}));
  at::Tensor flat_in = detail::movable(in.view({-1}));
  return launch("all_to_all_single", CommType::all_to_all_single, pg, t, out, finish,
                [&](c10d::Backend& b) {
                  std::vector<int64_t> splits;  // empty = even
                  return b.alltoall_base(flat_out, flat_in, splits, splits);
                })
      .wait();
}

at::Tensor all_to_all_single(const at::Tensor& t, const std::vector<int64_t>& output_split_sizes,
                             const std::vector<int64_t>& input_split_sizes, ProcessGroup& pg) {
  auto splits_str = [](const std::vector<int64_t>& v) { return c10::str(c10::ArrayRef(v)); };
  if (detail::tape_open())
    return detail::taped(
        tape_key("all_to_all_single out " + splits_str(output_split_sizes) + " in " +
                     splits_str(input_split_sizes),
                 t, pg),
        [&] { return all_to_all_single(t, output_split_sizes, input_split_sizes, pg); });
  const int64_t k = pg.size();
  TORCH_CHECK(t.dim() >= 1, "dtensor: all_to_all_single with split sizes needs a tensor of rows");
  TORCH_CHECK(static_cast<int64_t>(output_split_sizes.size()) == k &&
                  static_cast<int64_t>(input_split_sizes.size()) == k,
              "dtensor: all_to_all_single on group ", pg.name(), " of ", k,
              " ranks needs one split size per rank, got ", output_split_sizes.size(),
              " output and ", input_split_sizes.size(), " input split sizes");
  int64_t sent = 0, received = 0;
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(input_split_sizes[i] >= 0 && output_split_sizes[i] >= 0,
                "dtensor: all_to_all_single split sizes must not be negative");
    sent += input_split_sizes[i];
    received += output_split_sizes[i];
  }
  TORCH_CHECK(sent == t.size(0), "dtensor: all_to_all_single input split sizes ",
              splits_str(input_split_sizes), " add up to ", sent, " rows, the input has ",
              t.size(0));
  std::vector<int64_t> out_shape = t.sizes().vec();
  out_shape[0] = received;
  at::Tensor in = detail::dense(t).contiguous();
  at::Tensor out = at::empty(out_shape, in.options());
  if (k == 1) {
    record(CommType::all_to_all_single, t, pg);
    return in.clone();
  }
  // The engines count split sizes in rows of dim 0 of the tensors they get: the byte view of a
  // dtype an engine lacks has as many rows, each row_bytes wide.
  const int64_t row = t.size(0) > 0 ? t.numel() / t.size(0) : 0;
  auto rows_of = [&](const at::Tensor& x, int64_t n) {
    at::Tensor m = detail::movable(x.view({-1}));
    return m.view({n, n > 0 ? m.numel() / n : row});
  };
  at::Tensor engine_in = rows_of(in, t.size(0));
  at::Tensor engine_out = rows_of(out, received);
  std::vector<int64_t> out_splits = output_split_sizes, in_splits = input_split_sizes;
  return launch("all_to_all_single", CommType::all_to_all_single, pg, t, out, nullptr,
                [&](c10d::Backend& b) {
                  return b.alltoall_base(engine_out, engine_in, out_splits, in_splits);
                })
      .wait();
}

at::Tensor broadcast(const at::Tensor& t, int src, ProcessGroup& pg) {
  if (detail::tape_open())
    return detail::taped(tape_key("broadcast from " + std::to_string(src), t, pg),
                         [&] { return broadcast(t, src, pg); });
  at::Tensor buf = t.clone(at::MemoryFormat::Contiguous);
  if (pg.size() == 1) {
    record(CommType::broadcast, t, pg);
    return buf;
  }
  at::Tensor engine = detail::movable(buf);
  return launch("broadcast", CommType::broadcast, pg, t, buf, nullptr,
                [&](c10d::Backend& b) {
                  std::vector<at::Tensor> v{engine};
                  c10d::BroadcastOptions o;
                  o.rootRank = src;
                  return b.broadcast(v, o);
                })
      .wait();
}

at::Tensor scatter(const std::vector<at::Tensor>& chunks_on_src, const at::Tensor& like, int src,
                   ProcessGroup& pg) {
  if (detail::tape_open())
    return detail::taped(tape_key("scatter from " + std::to_string(src), like, pg),
                         [&] { return scatter(chunks_on_src, like, src, pg); });
  at::Tensor out = at::empty(like.sizes(), like.options());
  if (pg.size() == 1) {
    record(CommType::scatter, like, pg);
    return out.copy_(chunks_on_src.at(0));
  }
  std::vector<at::Tensor> outs{detail::movable(out)};
  std::vector<std::vector<at::Tensor>> ins;
  if (pg.rank() == src) {
    std::vector<at::Tensor> cs;
    for (const auto& c : chunks_on_src) cs.push_back(detail::movable(detail::dense(c)));
    ins.push_back(std::move(cs));
  }
  return launch("scatter", CommType::scatter, pg, like, out, nullptr,
                [&](c10d::Backend& b) {
                  c10d::ScatterOptions o;
                  o.rootRank = src;
                  return b.scatter(outs, ins, o);
                })
      .wait();
}

namespace {

// "send float64[2,8,32] (4096 bytes) to group rank 1 with tag 3 as message #2 on channel
// pp:0->1 (group rank 0 of 2, mesh dim 0)".
std::string describe_p2p(const char* what, ProcessGroup& pg, const at::Tensor& t, int peer, int tag,
                         int64_t seq, const std::string& channel) {
  std::string s = std::string(what) + " " + detail::signature(t) + " (" +
                  std::to_string(t.numel() * t.element_size()) + " bytes) " +
                  (std::string(what) == "send" ? "to" : "from") + " group rank " +
                  std::to_string(peer) + " (global rank " + std::to_string(pg.global_rank(peer)) +
                  ") with tag " + std::to_string(tag) + " as message #" + std::to_string(seq) +
                  " on channel " + channel + " (group rank " + std::to_string(pg.rank()) + " of " +
                  std::to_string(pg.size());
  if (pg.mesh_dim() >= 0) s += ", mesh dim " + std::to_string(pg.mesh_dim());
  return s + ")";
}

PendingResult launch_p2p(bool sending, ProcessGroup& pg, int peer, int tag, at::Tensor buffer) {
  const char* name = sending ? "send" : "recv";
  TORCH_CHECK(!detail::tape_open(), "dtensor: ", name, " on group ", pg.name(),
              " inside a collective tape (activation checkpointing): a point-to-point message "
              "cannot be recorded or replayed; keep sends and receives outside checkpointed "
              "regions");
  TORCH_CHECK(peer >= 0 && peer < pg.size() && peer != pg.rank(), "dtensor: ", name, " on group ",
              pg.name(), ": peer group rank ", peer, " is not another member (group ", "rank ",
              pg.rank(), " of ", pg.size(), ")");
  TORCH_CHECK(tag >= 0, "dtensor: ", name, ": tag must be non-negative, got ", tag);
  const int src = sending ? pg.rank() : peer, dst = sending ? peer : pg.rank();
  std::vector<at::Tensor> v{detail::movable(buffer)};
  record(sending ? CommType::send : CommType::recv, buffer, pg);
  const int64_t seq = detail::begin_p2p(pg, src, dst, buffer);
  const std::string channel = detail::p2p_channel(pg, src, dst);
  const std::string what = "rank " + std::to_string(pg.global_rank(pg.rank())) + ": " +
                           describe_p2p(name, pg, buffer, peer, tag, seq, channel);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    c10d::Backend& b = backend_for(pg, buffer);
    work = sending ? b.send(v, peer, tag) : b.recv(v, peer, tag);
  } catch (const std::exception& e) {
    detail::issue_failed(pg, seq, channel, what, e);
  }
  detail::attach(work.get(), pg, seq, channel,
                 buffer.device().is_cpu() && detail::cpu_collectives_block());
  return PendingResult(std::move(work), std::move(buffer), nullptr, what);
}

}  // namespace

PendingResult isend(const at::Tensor& t, int dst, ProcessGroup& pg, int tag) {
  return launch_p2p(/*sending=*/true, pg, dst, tag, detail::dense(t));
}

PendingResult irecv(const at::Tensor& like, int src, ProcessGroup& pg, int tag) {
  return launch_p2p(
      /*sending=*/false, pg, src, tag,
      at::empty(like.sizes(), like.options().memory_format(at::MemoryFormat::Contiguous)));
}

void send(const at::Tensor& t, int dst, ProcessGroup& pg, int tag) {
  isend(t, dst, pg, tag).wait();
}

at::Tensor recv(const at::Tensor& like, int src, ProcessGroup& pg, int tag) {
  return irecv(like, src, pg, tag).wait();
}

}  // namespace dtensor::comm
