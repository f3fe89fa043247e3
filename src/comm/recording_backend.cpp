#include "dtensor/comm/recording_backend.h"

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

#include <mutex>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "dtensor/comm/comm_debug_mode.h"

namespace dtensor::comm {
namespace {

struct Log {
  std::mutex mu;
  std::vector<RecordedOp> ops;
};

Log& log() {
  static Log l;
  return l;
}

thread_local std::string phase_label = "forward";

int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// A finished Work: its future is completed with the call's tensors, so waiting returns at once.
c10::intrusive_ptr<c10d::Work> done(const at::Tensor& t) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  future->markCompleted(c10::IValue(std::vector<at::Tensor>{t}));
  return c10d::Work::create_from_future(future);
}

}  // namespace

RecordingPhase::RecordingPhase(std::string phase) : previous_(std::move(phase)) {
  std::swap(previous_, phase_label);
}
RecordingPhase::~RecordingPhase() { phase_label = std::move(previous_); }
const std::string& RecordingPhase::current() { return phase_label; }

std::vector<RecordedOp> recorded_ops() {
  std::lock_guard<std::mutex> g(log().mu);
  return log().ops;
}

void clear_recorded_ops() {
  std::lock_guard<std::mutex> g(log().mu);
  log().ops.clear();
}

RecordingBackend::RecordingBackend(std::string group, int rank, int size, int mesh_dim)
    : c10d::Backend(rank, size), group_(std::move(group)), mesh_dim_(mesh_dim) {}

c10::intrusive_ptr<c10d::Work> RecordingBackend::complete(const char* op, const at::Tensor& t,
                                                          int64_t bytes) {
  RecordedOp r;
  r.op = op;
  r.group = group_;
  r.group_size = getSize();
  r.mesh_dim = mesh_dim_;
  r.dtype = t.defined() ? t.scalar_type() : c10::ScalarType::Undefined;
  r.bytes = bytes >= 0 ? bytes : bytes_of(t);
  r.module_path = ModuleScope::current_path();
  r.phase = BackwardScope::active() ? "backward" : RecordingPhase::current();
  {
    std::lock_guard<std::mutex> g(log().mu);
    log().ops.push_back(std::move(r));
  }
  return done(t);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions&) {
  return complete("broadcast", tensors.at(0));
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions&) {
  return complete("all_reduce", tensors.at(0));
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allgather(std::vector<std::vector<at::Tensor>>&,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions&) {
  return complete("all_gather", inputs.at(0));
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::_allgather_base(at::Tensor&, at::Tensor& input,
                                                                 const c10d::AllgatherOptions&) {
  return complete("all_gather_into_tensor", input);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions&) {
  int64_t bytes = 0;
  for (const auto& t : inputs.at(0)) bytes += bytes_of(t);
  return complete("reduce_scatter", outputs.at(0), bytes);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::_reduce_scatter_base(
    at::Tensor&, at::Tensor& input, const c10d::ReduceScatterOptions&) {
  return complete("reduce_scatter_tensor", input);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::alltoall_base(at::Tensor&, at::Tensor& input,
                                                               std::vector<int64_t>&,
                                                               std::vector<int64_t>&,
                                                               const c10d::AllToAllOptions&) {
  return complete("all_to_all_single", input);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>&,
                                                         const c10d::ScatterOptions&) {
  return complete("scatter", outputs.at(0));
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::send(std::vector<at::Tensor>& tensors, int, int) {
  return complete("send", tensors.at(0));
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::recv(std::vector<at::Tensor>& tensors, int, int) {
  return complete("recv", tensors.at(0));
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::barrier(const c10d::BarrierOptions&) {
  return complete("barrier", at::Tensor());
}

}  // namespace dtensor::comm
