#include "dtensor/pp/pipeline.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <sstream>

#include "dtensor/comm/collectives.h"
#include "dtensor/comm/comm_debug_mode.h"
#include "dtensor/util/error_message.h"
#include "dtensor/comm/failure.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"

namespace dtensor::pp {
namespace {

// Tags keep the messages of one step apart: the tied gradients, the activation shape of each
// stage boundary b (between stages b and b + 1), and the forward activation and backward
// gradient of each boundary and micro-batch.
constexpr int kTiedTag = 1;
constexpr int64_t kMaxStages = 128;
int shape_tag(int64_t boundary) { return static_cast<int>(2 + boundary); }
int forward_tag(int64_t boundary, int64_t m, int64_t microbatch) {
  return static_cast<int>(2 + kMaxStages + 2 * (boundary * m + microbatch));
}
int backward_tag(int64_t boundary, int64_t m, int64_t microbatch) {
  return forward_tag(boundary, m, microbatch) + 1;
}
// MPI guarantees tags up to 32767: stages * micro-batches stay below this.
constexpr int64_t kMaxStageMicrobatches = 16000;

// Shape message: dtype, number of dims, then the sizes.
constexpr int64_t kMaxDims = 8;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
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
    fail(stage, where, util::error_message(e));
  }
}

at::Tensor local_of(const at::Tensor& t) { return is_dtensor(t) ? local_tensor(t) : t; }

// Receives a micro-batch's activation from stage `src`. The first one is preceded by its dtype
// and shape, which `like` keeps for the later ones.
at::Tensor recv_activation(std::optional<at::Tensor>& like, const at::TensorOptions& options,
                           int src, comm::ProcessGroup& pg, int shape_tag, int tag) {
  if (!like) {
    at::Tensor meta =
        comm::recv(at::empty({2 + kMaxDims}, options.dtype(at::kLong)), src, pg, shape_tag).cpu();
    const auto* v = meta.data_ptr<int64_t>();
    std::vector<int64_t> sizes(v + 2, v + 2 + v[1]);
    like = at::empty(sizes, options.dtype(static_cast<at::ScalarType>(v[0])));
  }
  return comm::recv(*like, src, pg, tag);
}

// Starts sending a micro-batch's activation to stage `dst` (the first one's shape before it),
// adding the sends to `sends`; the counterpart of recv_activation. Nothing blocks: a rank that
// runs several stages must not wait for a peer to reach one of its receives.
void send_activation(const at::Tensor& out, std::optional<at::Tensor>& like, int dst,
                     comm::ProcessGroup& pg, int shape_tag, int tag,
                     std::vector<comm::PendingResult>& sends) {
  TORCH_CHECK(!is_dtensor(out),
              "the stage output crossing to the next stage is a DTensor; stage boundaries "
              "carry plain tensors: apply tensor parallelism without sequence parallelism so "
              "that activations between blocks are replicated local tensors");
  if (!like) {
    TORCH_CHECK(out.dim() <= kMaxDims, "stage outputs have at most ", kMaxDims, " dims, got ",
                out.dim());
    std::vector<int64_t> meta{static_cast<int64_t>(out.scalar_type()), out.dim()};
    for (int64_t d = 0; d < kMaxDims; ++d) meta.push_back(d < out.dim() ? out.size(d) : 0);
    sends.push_back(comm::isend(at::tensor(meta, at::kLong).to(out.device()), dst, pg, shape_tag));
    like = at::empty(out.sizes(), out.options());
  }
  TORCH_CHECK(out.sizes() == like->sizes() && out.scalar_type() == like->scalar_type(),
              "the stage output is ", out.scalar_type(), out.sizes(), " but the first step's was ",
              like->scalar_type(), like->sizes(),
              ": the pipeline exchanges activation shapes once; keep the micro-batch shape "
              "fixed or build a new PipelineStage");
  sends.push_back(comm::isend(out.detach(), dst, pg, tag));
}

}  // namespace

std::optional<DeviceMesh> get_pp_mesh(const DeviceMesh& mesh) { return mesh_for_role(mesh, "pp"); }

std::pair<int64_t, int64_t> stage_layer_range(int64_t n_layers, int64_t stage, int64_t num_stages) {
  TORCH_CHECK(num_stages >= 1 && stage >= 0 && stage < num_stages, "stage_layer_range: stage ",
              stage, " is not in [0, ", num_stages, ")");
  const int64_t base = n_layers / num_stages, extra = n_layers % num_stages;
  const int64_t first = stage * base + std::min(stage, extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

PipelineStage::PipelineStage(Forward forward, const DeviceMesh& mesh)
    : PipelineStage(std::move(forward), mesh, -1, -1) {}

PipelineStage::PipelineStage(Forward forward, const DeviceMesh& mesh, int64_t stage_index,
                             int64_t num_stages)
    : forward_(std::move(forward)),
      pp_mesh_([&] {
        auto pp = get_pp_mesh(mesh);
        TORCH_CHECK(pp,
                    "PipelineStage needs a mesh with a dimension named \"pp\" (or a 1-D mesh), ",
                    "got ", mesh.str());
        TORCH_CHECK(pp->contains_this_rank(), "PipelineStage: this rank is not in ", pp->str());
        return *pp;
      }()),
      stage_(stage_index < 0 ? pp_mesh_.get_local_rank() : stage_index),
      num_stages_(num_stages < 0 ? pp_mesh_.size() : num_stages) {
  TORCH_CHECK(forward_, "PipelineStage: the forward function is empty");
  const int64_t pp = pp_mesh_.size(), rank = pp_mesh_.get_local_rank();
  TORCH_CHECK(num_stages_ >= 1 && num_stages_ % pp == 0 && num_stages_ <= kMaxStages,
              "PipelineStage: ", num_stages_, " stages do not split evenly over the ", pp,
              " ranks of ", pp_mesh_.str(), " (at most ", kMaxStages, " stages)");
  TORCH_CHECK(stage_ >= 0 && stage_ < num_stages_ && rank_of(stage_) == rank,
              "PipelineStage: stage ", stage_, " of ", num_stages_, " runs on pp rank ",
              stage_ % pp, " (round-robin placement: rank r runs stages r, r + ", pp,
              ", ...), but this rank is pp rank ", rank, " of ", pp_mesh_.str());
  TORCH_CHECK(num_stages_ == pp || pp >= 2, "PipelineStage: ", num_stages_,
              " virtual stages need a pp dimension of at least 2 ranks, got ", pp_mesh_.str());
}

std::string PipelineStage::label() const {
  return "pipeline stage " + std::to_string(stage_) + " of " + std::to_string(num_stages());
}

void PipelineStage::tie_parameter(const at::Tensor& param, int64_t peer_stage) {
  TORCH_CHECK(param.defined() && param.requires_grad(), label(),
              ": tie_parameter needs a parameter that requires grad");
  TORCH_CHECK(
      peer_stage >= 0 && peer_stage < num_stages() && rank_of(peer_stage) != rank_of(stage_),
      label(), ": tie_parameter peer stage ", peer_stage, " must be a stage in [0, ", num_stages(),
      ") on another rank");
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
    const int peer = static_cast<int>(rank_of(tie.peer));
    auto sent = comm::isend(mine, peer, pg, kTiedTag);
    at::Tensor theirs = comm::irecv(mine, peer, pg, kTiedTag).wait();
    sent.wait();
    at::NoGradGuard no_grad;
    mine.add_(theirs);
  }
}

std::string format_actions(const std::vector<Action>& actions) {
  bool chunks = false;
  for (const Action& a : actions) chunks = chunks || a.chunk != 0;
  std::ostringstream o;
  for (size_t i = 0; i < actions.size(); ++i) {
    o << (i ? " " : "") << (actions[i].backward ? "B" : "F") << actions[i].microbatch;
    if (chunks) o << "." << actions[i].chunk;
  }
  return o.str();
}

Schedule::Schedule(PipelineStage& stage, int64_t n_microbatches, LossFn loss_fn)
    : Schedule(std::vector<PipelineStage*>{&stage}, n_microbatches, std::move(loss_fn)) {}

Schedule::Schedule(std::vector<PipelineStage*> stages, int64_t n_microbatches, LossFn loss_fn)
    : stages_(std::move(stages)),
      stage_([this]() -> PipelineStage& {
        TORCH_CHECK(!stages_.empty() && stages_[0], "pipeline schedule: no stage given");
        return *stages_[0];
      }()),
      n_microbatches_(n_microbatches),
      loss_fn_(std::move(loss_fn)) {
  TORCH_CHECK(n_microbatches >= 1 && n_microbatches * stage_.num_stages() <= kMaxStageMicrobatches,
              "pipeline schedule: n_microbatches must be in [1, ",
              kMaxStageMicrobatches / stage_.num_stages(), "] for ", stage_.num_stages(),
              " stages, got ", n_microbatches);
  TORCH_CHECK(stage_.stage_index() < stage_.pp_mesh().size(), "pipeline schedule: stage #0 of ",
              "this rank must be stage ", stage_.pp_mesh().get_local_rank(), " of ",
              stage_.num_stages(), " (its first in the round-robin placement), got ",
              stage_.label());
  for (size_t k = 0; k < stages_.size(); ++k) {
    const PipelineStage* st = stages_[k];
    TORCH_CHECK(st && st->num_stages() == stage_.num_stages() &&
                    st->stage_index() ==
                        stage_.stage_index() + static_cast<int64_t>(k) * stage_.pp_mesh().size(),
                "pipeline schedule: stage #", k, " of this rank must be stage ",
                stage_.stage_index() + static_cast<int64_t>(k) * stage_.pp_mesh().size(), " of ",
                stage_.num_stages(), " (round-robin placement), got ",
                st ? st->label() : std::string("none"));
    TORCH_CHECK(!st->is_last() || loss_fn_, st->label(), ": the last stage needs a loss function");
  }
  TORCH_CHECK(static_cast<int64_t>(stages_.size()) * stage_.pp_mesh().size() == stage_.num_stages(),
              "pipeline schedule: this rank runs ", stages_.size(), " stages but ",
              stage_.num_stages(), " stages over ", stage_.pp_mesh().size(), " ranks make ",
              stage_.num_stages() / stage_.pp_mesh().size(), " per rank");
}

at::Tensor Schedule::step(const at::Tensor& inputs, const at::Tensor& targets) {
  const auto start = Clock::now();
  timing_ = {};
  const int64_t m = n_microbatches_, chunks = static_cast<int64_t>(stages_.size());
  auto& pg = stage_.pp_mesh_.group(0);
  auto split = [&](const PipelineStage& st, const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.defined() && t.dim() >= 1 && t.size(0) % m == 0, st.label(), ": ", what,
                " must be a tensor whose dim 0 (", t.defined() && t.dim() ? t.size(0) : 0,
                ") splits into ", m, " equal micro-batches");
    return t.chunk(m, 0);
  };
  std::vector<at::Tensor> in_mb, target_mb;
  for (const PipelineStage* st : stages_) {
    if (st->is_first()) in_mb = split(*st, inputs, "inputs");
    if (st->is_last()) target_mb = split(*st, targets, "targets");
  }

  struct Micro {
    at::Tensor input, output, loss;
  };
  std::vector<std::vector<Micro>> micro(chunks, std::vector<Micro>(m));
  for (PipelineStage* st : stages_)
    if (st->sync_hook_) guarded(*st, "start of step", [&] { st->sync_hook_(false); });
  std::vector<comm::PendingResult> sends;
  losses_.assign(stages_.back()->is_last() ? m : 0, at::Tensor());
  auto device_options = at::TensorOptions().device(stage_.pp_mesh_.device());

  auto forward = [&](PipelineStage& st, int64_t k, int64_t i) {
    const int64_t g = st.stage_index();
    at::Tensor x;
    if (st.is_first()) {
      x = in_mb[i];
    } else {
      x = recv_activation(st.input_like_, device_options, static_cast<int>(st.rank_of(g - 1)), pg,
                          shape_tag(g - 1), forward_tag(g - 1, m, i));
      x.requires_grad_(true);
    }
    const auto t0 = Clock::now();
    at::Tensor out = st.forward(x);
    if (st.is_last()) {
      micro[k][i].loss = loss_fn_(out, target_mb[i]);
      TORCH_CHECK(micro[k][i].loss.numel() == 1, "the loss function must return one value, got ",
                  micro[k][i].loss.sizes());
      losses_[i] = micro[k][i].loss.detach();
    }
    timing_.compute_s += seconds_since(t0);
    micro[k][i].input = x;
    micro[k][i].output = out;
    if (st.is_last()) return;
    send_activation(out, st.output_like_, static_cast<int>(st.rank_of(g + 1)), pg, shape_tag(g),
                    forward_tag(g, m, i), sends);
  };

  auto backward = [&](PipelineStage& st, int64_t k, int64_t i) {
    BackwardScope in_backward;  // its messages count as backward, as the autograd pass does
    const int64_t g = st.stage_index();
    Micro& mb = micro[k][i];
    if (i == m - 1 && st.sync_hook_) st.sync_hook_(true);
    if (st.is_last()) {
      const auto t0 = Clock::now();
      (mb.loss / static_cast<double>(m)).backward();
      timing_.compute_s += seconds_since(t0);
    } else {
      at::Tensor grad = comm::recv(*st.output_like_, static_cast<int>(st.rank_of(g + 1)), pg,
                                   backward_tag(g, m, i));
      const auto t0 = Clock::now();
      if (mb.output.requires_grad()) mb.output.backward(grad);
      timing_.compute_s += seconds_since(t0);
    }
    if (!st.is_first()) {
      at::Tensor gin = mb.input.grad();
      if (!gin.defined()) gin = at::zeros_like(mb.input);
      sends.push_back(
          comm::isend(gin, static_cast<int>(st.rank_of(g - 1)), pg, backward_tag(g - 1, m, i)));
    }
    mb = Micro{};  // free the micro-batch's activations
  };

  for (const Action& a : actions()) {
    TORCH_CHECK(a.chunk >= 0 && a.chunk < chunks && a.microbatch >= 0 && a.microbatch < m,
                "pipeline schedule: action ", format_actions({a}), " is out of range");
    PipelineStage& st = *stages_[a.chunk];
    const std::string where = std::string(a.backward ? "backward" : "forward") +
                              " of micro-batch " + std::to_string(a.microbatch);
    guarded(st, where, [&] {
      if (action_hook_) action_hook_(a);
      if (a.backward) {
        backward(st, a.chunk, a.microbatch);
      } else {
        forward(st, a.chunk, a.microbatch);
      }
    });
  }
  guarded(stage_, "end of step, waiting for its sends", [&] {
    for (auto& sent : sends) sent.wait();
  });
  for (PipelineStage* st : stages_)
    guarded(*st, "tied gradient exchange", [&] { st->sync_tied_gradients(); });
  timing_.total_s = seconds_since(start);
  if (losses_.empty()) return {};
  return at::stack(losses_).mean();
}

at::Tensor Schedule::eval(const at::Tensor& inputs, int64_t n_microbatches) {
  at::NoGradGuard no_grad;
  const int64_t m = n_microbatches > 0 ? n_microbatches : n_microbatches_;
  auto& pg = stage_.pp_mesh_.group(0);
  const auto device_options = at::TensorOptions().device(stage_.pp_mesh_.device());
  std::vector<at::Tensor> in_mb, outputs;
  if (stages_.front()->is_first()) {
    TORCH_CHECK(inputs.defined() && inputs.dim() >= 1 && inputs.size(0) % m == 0,
                stages_.front()->label(), ": evaluation inputs must be a tensor whose dim 0 (",
                inputs.defined() && inputs.dim() ? inputs.size(0) : 0, ") splits into ", m,
                " equal micro-batches");
    in_mb = inputs.chunk(m, 0);
  }
  std::vector<comm::PendingResult> sends;
  // Stage by stage in order (a rank's stages are pp apart): every receive waits only for a
  // lower stage, which its rank reaches first, and sends do not block.
  for (PipelineStage* st : stages_) {
    const int64_t g = st->stage_index();
    // This call's activation shapes at the stage's boundaries, sent with the first micro-batch.
    std::optional<at::Tensor> in_like, out_like;
    for (int64_t i = 0; i < m; ++i) {
      guarded(*st, "evaluation forward of micro-batch " + std::to_string(i), [&] {
        const at::Tensor x =
            st->is_first()
                ? in_mb[i]
                : recv_activation(in_like, device_options, static_cast<int>(st->rank_of(g - 1)), pg,
                                  shape_tag(g - 1), forward_tag(g - 1, m, i));
        at::Tensor out = st->forward(x);
        if (st->is_last()) {
          outputs.push_back(out);
          return;
        }
        send_activation(out, out_like, static_cast<int>(st->rank_of(g + 1)), pg, shape_tag(g),
                        forward_tag(g, m, i), sends);
      });
    }
  }
  guarded(stage_, "end of evaluation, waiting for its sends", [&] {
    for (auto& sent : sends) sent.wait();
  });
  if (outputs.empty()) return {};
  return outputs.size() == 1 ? outputs.front() : at::cat(outputs, 0);
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

std::vector<Action> interleaved_1f1b_actions(int64_t pp, int64_t rank, int64_t v, int64_t m) {
  TORCH_CHECK(pp >= 1 && rank >= 0 && rank < pp && v >= 1 && m >= 1,
              "interleaved_1f1b_actions: bad arguments pp=", pp, " rank=", rank, " v=", v,
              " M=", m);
  const int64_t rounds = std::max<int64_t>(1, m / pp);
  TORCH_CHECK(m % rounds == 0, "ScheduleInterleaved1F1B: ", m, " micro-batches do not split into ",
              rounds, " rounds of equal size on ", pp, " ranks; use a multiple of ", pp,
              " or fewer than ", 2 * pp);
  const int64_t round = m / rounds, total = v * m;
  const int64_t warmup = std::min(total, (v - 1) * round + 2 * (pp - 1 - rank));
  std::vector<int64_t> next_f(v, 0), next_b(v, 0);
  std::vector<Action> out;
  int64_t f = 0, b = 0;
  auto forward = [&] {
    const int64_t k = (f++ / round) % v;
    out.push_back({false, next_f[k]++, k});
  };
  auto backward = [&] {
    const int64_t k = v - 1 - (b++ / round) % v;
    out.push_back({true, next_b[k]++, k});
  };
  while (f < warmup) forward();
  while (f < total) {
    forward();
    backward();
  }
  while (b < total) backward();
  return out;
}

ScheduleInterleaved1F1B::ScheduleInterleaved1F1B(std::vector<PipelineStage*> stages,
                                                 int64_t n_microbatches, LossFn loss_fn)
    : Schedule(std::move(stages), n_microbatches, std::move(loss_fn)) {
  TORCH_CHECK(stage_.pp_mesh().size() >= 2,
              "ScheduleInterleaved1F1B needs a pp dimension of at least 2 ranks, got ",
              stage_.pp_mesh().str());
  actions();  // checks the rounds
}

std::vector<Action> ScheduleInterleaved1F1B::actions() const {
  return interleaved_1f1b_actions(stage_.pp_mesh().size(), stage_.pp_mesh().get_local_rank(),
                                  virtual_stages(), n_microbatches_);
}

double bubble_fraction(int64_t pp, int64_t virtual_stages, int64_t n_microbatches) {
  return static_cast<double>(pp - 1) /
         static_cast<double>(virtual_stages * n_microbatches + pp - 1);
}

}  // namespace dtensor::pp
