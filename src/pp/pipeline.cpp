#include "dtensor/pp/pipeline.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <sstream>

#include "dtensor/comm/collectives.h"
#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/comm/failure.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"

namespace dtensor::pp {
namespace {

// Tags keep the messages of one step apart: the activation shape, the tied gradients, and the
// forward activation and backward gradient of each micro-batch.
constexpr int kShapeTag = 0;
constexpr int kTiedTag = 1;
int forward_tag(int64_t microbatch) { return static_cast<int>(2 + 2 * microbatch); }
int backward_tag(int64_t microbatch) { return static_cast<int>(3 + 2 * microbatch); }
// MPI guarantees tags up to 32767.
constexpr int64_t kMaxMicrobatches = 16000;

// Shape message: dtype, number of dims, then the sizes.
constexpr int64_t kMaxDims = 8;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string error_text(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

// Ends this step on every rank: the message names the stage and what it was doing, and the
// other ranks learn of it through the failure report (their waits then end too).
[[noreturn]] void fail(const PipelineStage& stage, const std::string& where,
                       const std::string& why) {
  const std::string msg = "dtensor: " + stage.label() + " (rank " +
                          std::to_string(comm::get_rank()) + "), " + where + ": " + why;
  comm::report_failure(msg);
  TORCH_CHECK(false, msg);
}

template <typename F>
void guarded(const PipelineStage& stage, const std::string& where, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    fail(stage, where, error_text(e));
  }
}

at::Tensor local_of(const at::Tensor& t) { return is_dtensor(t) ? local_tensor(t) : t; }

// Receives a micro-batch's activation from stage `src`. The first one is preceded by its dtype
// and shape, which `like` keeps for the later ones.
at::Tensor recv_activation(std::optional<at::Tensor>& like, const at::TensorOptions& options,
                           int src, comm::ProcessGroup& pg, int tag) {
  if (!like) {
    at::Tensor meta =
        comm::recv(at::empty({2 + kMaxDims}, options.dtype(at::kLong)), src, pg, kShapeTag).cpu();
    const auto* v = meta.data_ptr<int64_t>();
    std::vector<int64_t> sizes(v + 2, v + 2 + v[1]);
    like = at::empty(sizes, options.dtype(static_cast<at::ScalarType>(v[0])));
  }
  return comm::recv(*like, src, pg, tag);
}

// Starts sending a micro-batch's activation to stage `dst`; the counterpart of recv_activation.
comm::PendingResult send_activation(const at::Tensor& out, std::optional<at::Tensor>& like, int dst,
                                    comm::ProcessGroup& pg, int tag) {
  TORCH_CHECK(!is_dtensor(out),
              "the stage output crossing to the next stage is a DTensor; stage boundaries "
              "carry plain tensors: apply tensor parallelism without sequence parallelism so "
              "that activations between blocks are replicated local tensors");
  if (!like) {
    TORCH_CHECK(out.dim() <= kMaxDims, "stage outputs have at most ", kMaxDims, " dims, got ",
                out.dim());
    std::vector<int64_t> meta{static_cast<int64_t>(out.scalar_type()), out.dim()};
    for (int64_t d = 0; d < kMaxDims; ++d) meta.push_back(d < out.dim() ? out.size(d) : 0);
    comm::send(at::tensor(meta, at::kLong).to(out.device()), dst, pg, kShapeTag);
    like = at::empty(out.sizes(), out.options());
  }
  TORCH_CHECK(out.sizes() == like->sizes() && out.scalar_type() == like->scalar_type(),
              "the stage output is ", out.scalar_type(), out.sizes(), " but the first step's was ",
              like->scalar_type(), like->sizes(),
              ": the pipeline exchanges activation shapes once; keep the micro-batch shape "
              "fixed or build a new PipelineStage");
  return comm::isend(out.detach(), dst, pg, tag);
}

}  // namespace

std::optional<DeviceMesh> get_pp_mesh(const DeviceMesh& mesh) {
  if (mesh.has_dim_names()) {
    for (const auto& name : mesh.dim_names())
      if (name == "pp") return mesh.ndim() == 1 ? mesh : mesh["pp"];
    return std::nullopt;
  }
  if (mesh.ndim() == 1) return mesh;
  return std::nullopt;
}

std::pair<int64_t, int64_t> stage_layer_range(int64_t n_layers, int64_t stage, int64_t num_stages) {
  TORCH_CHECK(num_stages >= 1 && stage >= 0 && stage < num_stages, "stage_layer_range: stage ",
              stage, " is not in [0, ", num_stages, ")");
  const int64_t base = n_layers / num_stages, extra = n_layers % num_stages;
  const int64_t first = stage * base + std::min(stage, extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

PipelineStage::PipelineStage(Forward forward, const DeviceMesh& mesh)
    : forward_(std::move(forward)),
      pp_mesh_([&] {
        auto pp = get_pp_mesh(mesh);
        TORCH_CHECK(pp,
                    "PipelineStage needs a mesh with a dimension named \"pp\" (or a 1-D mesh), ",
                    "got ", mesh.str());
        TORCH_CHECK(pp->contains_this_rank(), "PipelineStage: this rank is not in ", pp->str());
        return *pp;
      }()),
      stage_(pp_mesh_.get_local_rank()) {
  TORCH_CHECK(forward_, "PipelineStage: the forward function is empty");
}

std::string PipelineStage::label() const {
  return "pipeline stage " + std::to_string(stage_) + " of " + std::to_string(num_stages());
}

void PipelineStage::tie_parameter(const at::Tensor& param, int64_t peer_stage) {
  TORCH_CHECK(param.defined() && param.requires_grad(), label(),
              ": tie_parameter needs a parameter that requires grad");
  TORCH_CHECK(peer_stage >= 0 && peer_stage < num_stages() && peer_stage != stage_, label(),
              ": tie_parameter peer stage ", peer_stage, " must be another stage in [0, ",
              num_stages(), ")");
  ties_.push_back({param, peer_stage});
}

void PipelineStage::sync_tied_gradients() {
  auto& pg = pp_mesh_.group(0);
  for (size_t k = 0; k < ties_.size(); ++k) {
    const auto& tie = ties_[k];
    at::Tensor grad = tie.param.grad();
    TORCH_CHECK(grad.defined(), label(), ": tied parameter #", k, " (shared with stage ", tie.peer,
                ") has no gradient after backward; did the stage use it?");
    if (is_dtensor(grad) && is_dtensor(tie.param) &&
        spec_of(grad).placements() != spec_of(tie.param).placements()) {
      // Both ends exchange their shard of the parameter's layout (a gradient may come back
      // Partial or Replicate: an embedding's, say).
      at::NoGradGuard no_grad;
      grad = redistribute(grad, spec_of(tie.param).mesh(), spec_of(tie.param).placements());
      tie.param.mutable_grad() = grad;
    }
    const at::Tensor mine = local_of(grad);
    // Both ends post their send before their receive: neither waits for the other first.
    auto sent = comm::isend(mine, static_cast<int>(tie.peer), pg, kTiedTag);
    at::Tensor theirs = comm::irecv(mine, static_cast<int>(tie.peer), pg, kTiedTag).wait();
    sent.wait();
    at::NoGradGuard no_grad;
    mine.add_(theirs);
  }
}

std::string format_actions(const std::vector<Action>& actions) {
  std::ostringstream o;
  for (size_t i = 0; i < actions.size(); ++i)
    o << (i ? " " : "") << (actions[i].backward ? "B" : "F") << actions[i].microbatch;
  return o.str();
}

Schedule::Schedule(PipelineStage& stage, int64_t n_microbatches, LossFn loss_fn)
    : stage_(stage), n_microbatches_(n_microbatches), loss_fn_(std::move(loss_fn)) {
  TORCH_CHECK(n_microbatches >= 1 && n_microbatches <= kMaxMicrobatches,
              "pipeline schedule: n_microbatches must be in [1, ", kMaxMicrobatches, "], got ",
              n_microbatches);
  TORCH_CHECK(!stage.is_last() || loss_fn_, stage.label(),
              ": the last stage needs a loss function");
}

at::Tensor Schedule::step(const at::Tensor& inputs, const at::Tensor& targets) {
  const auto start = Clock::now();
  timing_ = {};
  const int64_t m = n_microbatches_, s = stage_.stage_index();
  auto& pg = stage_.pp_mesh_.group(0);
  auto split = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.defined() && t.dim() >= 1 && t.size(0) % m == 0, stage_.label(), ": ", what,
                " must be a tensor whose dim 0 (", t.defined() && t.dim() ? t.size(0) : 0,
                ") splits into ", m, " equal micro-batches");
    return t.chunk(m, 0);
  };
  std::vector<at::Tensor> in_mb, target_mb;
  if (stage_.is_first()) in_mb = split(inputs, "inputs");
  if (stage_.is_last()) target_mb = split(targets, "targets");

  struct Micro {
    at::Tensor input, output, loss;
  };
  std::vector<Micro> micro(m);
  std::vector<comm::PendingResult> sends;
  std::vector<at::Tensor> losses;
  auto device_options = at::TensorOptions().device(stage_.pp_mesh_.device());

  auto forward = [&](int64_t i) {
    at::Tensor x;
    if (stage_.is_first()) {
      x = in_mb[i];
    } else {
      x = recv_activation(stage_.input_like_, device_options, static_cast<int>(s - 1), pg,
                          forward_tag(i));
      x.requires_grad_(true);
    }
    const auto t0 = Clock::now();
    at::Tensor out = stage_.forward(x);
    if (stage_.is_last()) {
      micro[i].loss = loss_fn_(out, target_mb[i]);
      TORCH_CHECK(micro[i].loss.numel() == 1, "the loss function must return one value, got ",
                  micro[i].loss.sizes());
      losses.push_back(micro[i].loss.detach());
    }
    timing_.compute_s += seconds_since(t0);
    micro[i].input = x;
    micro[i].output = out;
    if (stage_.is_last()) return;
    sends.push_back(
        send_activation(out, stage_.output_like_, static_cast<int>(s + 1), pg, forward_tag(i)));
  };

  auto backward = [&](int64_t i) {
    BackwardScope in_backward;  // its messages count as backward, as the autograd pass does
    Micro& mb = micro[i];
    if (stage_.is_last()) {
      const auto t0 = Clock::now();
      (mb.loss / static_cast<double>(m)).backward();
      timing_.compute_s += seconds_since(t0);
    } else {
      at::Tensor grad =
          comm::recv(*stage_.output_like_, static_cast<int>(s + 1), pg, backward_tag(i));
      const auto t0 = Clock::now();
      if (mb.output.requires_grad()) mb.output.backward(grad);
      timing_.compute_s += seconds_since(t0);
    }
    if (!stage_.is_first()) {
      at::Tensor g = mb.input.grad();
      if (!g.defined()) g = at::zeros_like(mb.input);
      sends.push_back(comm::isend(g, static_cast<int>(s - 1), pg, backward_tag(i)));
    }
    mb = Micro{};  // free the micro-batch's activations
  };

  for (const Action& a : actions()) {
    const std::string where = std::string(a.backward ? "backward" : "forward") +
                              " of micro-batch " + std::to_string(a.microbatch);
    guarded(stage_, where, [&] {
      if (a.backward) {
        backward(a.microbatch);
      } else {
        forward(a.microbatch);
      }
    });
  }
  guarded(stage_, "end of step, waiting for its sends", [&] {
    for (auto& sent : sends) sent.wait();
  });
  guarded(stage_, "tied gradient exchange", [&] { stage_.sync_tied_gradients(); });
  timing_.total_s = seconds_since(start);
  if (!stage_.is_last()) return {};
  return at::stack(losses).mean();
}

void PipelineStage::set_boundary_activations(std::optional<at::Tensor> input_like,
                                             std::optional<at::Tensor> output_like) {
  TORCH_CHECK(!input_like || !is_first(), label(), ": the first stage receives no activation");
  TORCH_CHECK(!output_like || !is_last(), label(), ": the last stage sends no activation");
  if (input_like) input_like_ = at::empty(input_like->sizes(), input_like->options());
  if (output_like) output_like_ = at::empty(output_like->sizes(), output_like->options());
}

std::vector<Action> ScheduleGPipe::actions() const {
  std::vector<Action> out;
  for (int64_t i = 0; i < n_microbatches_; ++i) out.push_back({false, i});
  for (int64_t i = 0; i < n_microbatches_; ++i) out.push_back({true, i});
  return out;
}

std::vector<Action> Schedule1F1B::actions() const {
  const int64_t m = n_microbatches_;
  const int64_t warmup = std::min(stage_.num_stages() - 1 - stage_.stage_index(), m);
  std::vector<Action> out;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back({false, f});
  while (f < m) {
    out.push_back({false, f++});
    out.push_back({true, b++});
  }
  while (b < m) out.push_back({true, b++});
  return out;
}

}  // namespace dtensor::pp
