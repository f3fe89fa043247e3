#include "dtensor/ac/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <iterator>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "dtensor/comm/collective_tape.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/random.h"
#include "dtensor/tp/forward_wrapper.h"

namespace dtensor::ac {

const char* ac_mode_name(ACMode mode) {
  // Indexed by ACMode, in its declaration order.
  static constexpr const char* kNames[] = {"none", "full", "selective"};
  static_assert(std::size(kNames) == static_cast<size_t>(ACMode::selective) + 1);
  const auto i = static_cast<size_t>(mode);
  return i < std::size(kNames) ? kNames[i] : "?";
}

ACMode parse_ac_mode(const std::string& name) {
  for (ACMode m : {ACMode::none, ACMode::full, ACMode::selective})
    if (name == ac_mode_name(m)) return m;
  TORCH_CHECK(false, "dtensor::ac: unknown activation checkpointing mode '", name,
              "'; expected none, full or selective");
}

namespace {

// The random generators a recompute must replay: CPU, the CUDA device of the inputs (if any),
// and DTensor's stream.
struct RngSnapshot {
  at::Tensor cpu;
  std::optional<std::pair<at::Generator, at::Tensor>> cuda;
  random::StreamState dtensor{};

  static RngSnapshot take(std::optional<at::Device> cuda_device) {
    RngSnapshot s;
    auto cpu = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> l(cpu.mutex());
      s.cpu = cpu.get_state();
    }
    if (cuda_device) {
      auto gen = at::globalContext().defaultGenerator(*cuda_device);
      std::lock_guard<std::mutex> l(gen.mutex());
      s.cuda.emplace(gen, gen.get_state());
    }
    s.dtensor = random::get_state();
    return s;
  }
  void restore() const {
    auto cpu_gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> l(cpu_gen.mutex());
      cpu_gen.set_state(cpu);
    }
    if (cuda) {
      auto gen = cuda->first;
      std::lock_guard<std::mutex> l(gen.mutex());
      gen.set_state(cuda->second);
    }
    random::set_state(dtensor);
  }
};

// Calls f on every tensor inside v (tensors, tuples, lists) in order; returns v with each
// tensor replaced by f's result.
template <class F>
c10::IValue map_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) return f(v.toTensor());
  if (v.isTuple()) {
    std::vector<c10::IValue> elems;
    for (const auto& e : v.toTupleRef().elements()) elems.push_back(map_tensors(e, f));
    return c10::ivalue::Tuple::create(std::move(elems));
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorVector()) out.push_back(f(t));
    return out;
  }
  if (v.isList()) {
    c10::impl::GenericList out(v.toList().elementType());
    for (const c10::IValue& e : v.toListRef()) out.push_back(map_tensors(e, f));
    return out;
  }
  return v;
}

std::vector<at::Tensor> flatten(const c10::IValue& v) {
  std::vector<at::Tensor> out;
  map_tensors(v, [&](const at::Tensor& t) {
    out.push_back(t);
    return t;
  });
  return out;
}

// v with its tensors replaced by placeholders (defined, so the IValue stays a tensor): a
// structure to refill, which does not keep the tensors alive.
c10::IValue placeholders(const c10::IValue& v) {
  at::Tensor p = at::empty({0});
  return map_tensors(v, [&](const at::Tensor&) { return p; });
}

tp::ModuleCall map_call(const tp::ModuleCall& call,
                        const std::function<at::Tensor(const at::Tensor&)>& f) {
  tp::ModuleCall out;
  for (const auto& a : call.args) out.args.push_back(map_tensors(a, f));
  for (const auto& [k, v] : call.kwargs) out.kwargs.emplace_back(k, map_tensors(v, f));
  return out;
}

// What a checkpointed module needs per forward call to recompute it.
struct CheckpointState : torch::CustomClassHolder {
  std::string name;
  std::weak_ptr<torch::nn::Module> module;
  Rerun rerun;
  tp::ModuleCall call;  // the call's structure; its tensors are the Function's saved inputs
  size_t num_inputs = 0;
  size_t num_outputs = 0;
  c10::IValue output;  // the output's structure, with placeholders for its tensors
  // Where each saved parameter sits in the module tree: (module, name, index among the saved
  // parameters). The recompute runs on the parameters the forward used.
  struct ParamSite {
    std::weak_ptr<torch::nn::Module> owner;
    std::string name;
    size_t index;
  };
  std::vector<ParamSite> param_sites;
  bool replay = true;  // CheckpointOptions::replay_collectives
  comm::CollectiveTape tape;
  RngSnapshot rng;
};

// While alive, the module tree holds the parameters the forward ran on (when something swapped
// them since, as fully_shard swaps its gathered parameters back for the shards); restores the
// current ones when destroyed.
class ForwardParams {
 public:
  ForwardParams(const CheckpointState& state, const std::vector<at::Tensor>& saved_params) {
    for (const auto& site : state.param_sites) {
      std::shared_ptr<torch::nn::Module> owner = site.owner.lock();
      if (!owner) continue;
      const auto own = owner->named_parameters(/*recurse=*/false);
      const at::Tensor* now = own.find(site.name);
      const at::Tensor& then = saved_params[site.index];
      if (now == nullptr || now->unsafeGetTensorImpl() == then.unsafeGetTensorImpl()) continue;
      swapped_.push_back({owner, site.name, *now});
      replace_parameter(*owner, site.name, then);
    }
  }
  ~ForwardParams() {
    for (auto it = swapped_.rbegin(); it != swapped_.rend(); ++it)
      replace_parameter(*it->owner, it->name, it->current);
  }
  ForwardParams(const ForwardParams&) = delete;
  ForwardParams& operator=(const ForwardParams&) = delete;

 private:
  struct Swap {
    std::shared_ptr<torch::nn::Module> owner;
    std::string name;
    at::Tensor current;
  };
  std::vector<Swap> swapped_;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // inputs: the call's tensors, then the module's parameters that require grad.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, c10::IValue state_capsule,
                                                const tp::ForwardBody* body,
                                                const tp::ModuleCall* call) {
    auto* state = static_cast<CheckpointState*>(state_capsule.toCapsule().get());
    c10::IValue out;
    {
      std::optional<comm::RecordCollectives> record;
      if (state->replay) record.emplace(state->tape);
      out = (*body)(*call);
    }
    std::vector<at::Tensor> outs = flatten(out);
    state->num_outputs = outs.size();
    state->output = placeholders(out);
    torch::autograd::variable_list integral;  // marked in one call: each call replaces the set
    for (const at::Tensor& o : outs)
      if (o.defined() && !at::isFloatingType(o.scalar_type()) &&
          !at::isComplexType(o.scalar_type()))
        integral.push_back(o);
    if (!integral.empty()) ctx->mark_non_differentiable(integral);
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["state"] = std::move(state_capsule);
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* state = static_cast<CheckpointState*>(ctx->saved_data["state"].toCapsule().get());
    const auto saved = ctx->get_saved_variables();
    std::shared_ptr<torch::nn::Module> module = state->module.lock();
    TORCH_CHECK(module != nullptr, "dtensor::ac: checkpointed module '", state->name,
                "' was destroyed before backward; keep the model alive until backward is done");

    // The inputs again, as fresh leaves that require grad where the originals did.
    std::vector<at::Tensor> leaves;
    for (size_t i = 0; i < state->num_inputs; ++i) {
      at::Tensor t = saved[i].defined() ? saved[i].detach() : saved[i];
      if (t.defined() && saved[i].requires_grad()) t.requires_grad_(true);
      leaves.push_back(t);
    }
    size_t next = 0;
    tp::ModuleCall call = map_call(state->call, [&](const at::Tensor&) { return leaves[next++]; });

    c10::IValue out;
    {
      const RngSnapshot now = RngSnapshot::take(
          state->rng.cuda ? std::optional<at::Device>(state->rng.cuda->first.device())
                          : std::nullopt);
      state->rng.restore();
      try {
        at::AutoGradMode grad(true);
        std::optional<comm::ReplayCollectives> replay;
        if (state->replay)
          replay.emplace(state->tape, "the recompute of checkpointed module '" + state->name + "'");
        const std::vector<at::Tensor> saved_params(saved.begin() + state->num_inputs, saved.end());
        ForwardParams forward_params(*state, saved_params);
        tp::BodyOnlyCall body_only(*module, call);
        out = state->rerun(*module, call);
        if (replay) replay->finish();
      } catch (...) {
        now.restore();
        throw;
      }
      now.restore();
    }
    std::vector<at::Tensor> outs = flatten(out);
    TORCH_CHECK(outs.size() == state->num_outputs,
                "dtensor::ac: the recompute of checkpointed module '", state->name, "' returned ",
                outs.size(), " tensors, the forward ", state->num_outputs);

    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!grads[i].defined() || !outs[i].defined() || !outs[i].requires_grad()) continue;
      roots.push_back(outs[i]);
      root_grads.push_back(grads[i]);
    }
    std::vector<at::Tensor> targets;
    std::vector<size_t> target_index;
    for (size_t i = 0; i < saved.size(); ++i) {
      const at::Tensor& t = i < state->num_inputs ? leaves[i] : saved[i];
      if (t.defined() && t.requires_grad()) {
        targets.push_back(t);
        target_index.push_back(i);
      }
    }
    // One gradient per tensor input, then none for the three other arguments of forward.
    torch::autograd::variable_list result(saved.size() + 3);
    if (roots.empty() || targets.empty()) return result;
    auto g = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/false,
                                   /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t j = 0; j < g.size(); ++j) result[target_index[j]] = g[j];
    return result;
  }
};

struct Checkpointer {
  std::string name;  // empty: the module's fqn at call time
  Rerun rerun;
  bool replay_collectives = true;

  c10::IValue operator()(torch::nn::Module& module, const tp::ModuleCall& call,
                         const tp::ForwardBody& body) const {
    std::vector<at::Tensor> inputs;
    for (const auto& a : call.args)
      for (auto& t : flatten(a)) inputs.push_back(t);
    for (const auto& [k, v] : call.kwargs)
      for (auto& t : flatten(v)) inputs.push_back(t);
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : unique_parameters(module, /*recurse=*/true))
      if (p.requires_grad()) params.push_back(p);
    bool any_grad = false;
    for (const at::Tensor& t : inputs) any_grad = any_grad || (t.defined() && t.requires_grad());
    any_grad = any_grad || !params.empty();
    if (!c10::GradMode::is_enabled() || !any_grad) return body(call);

    auto state = c10::make_intrusive<CheckpointState>();
    state->name = name;
    if (state->name.empty()) {
      auto* h = dynamic_cast<tp::HookedModule*>(&module);
      state->name = h && !h->fqn().empty() ? h->fqn() : module.name();
    }
    state->module = module.weak_from_this();
    state->rerun = rerun;
    state->replay = replay_collectives;
    const at::Tensor placeholder = at::empty({0});
    state->call = map_call(call, [&](const at::Tensor&) { return placeholder; });
    state->num_inputs = inputs.size();
    std::unordered_map<const c10::TensorImpl*, size_t> param_index;
    for (size_t i = 0; i < params.size(); ++i) param_index[params[i].unsafeGetTensorImpl()] = i;
    for (const auto& m : module.named_modules("", /*include_self=*/true))
      for (const auto& p : m.value()->named_parameters(/*recurse=*/false)) {
        auto it = param_index.find(p.value().unsafeGetTensorImpl());
        if (it != param_index.end()) state->param_sites.push_back({m.value(), p.key(), it->second});
      }
    std::optional<at::Device> cuda;
    for (const at::Tensor& t : inputs)
      if (t.defined() && t.is_cuda()) cuda = t.device();
    state->rng = RngSnapshot::take(cuda);

    std::vector<at::Tensor> all = inputs;
    all.insert(all.end(), params.begin(), params.end());
    const torch::autograd::variable_list outs = CheckpointFunction::apply(
        at::TensorList(all),
        c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(state)), &body,
        &call);
    size_t k = 0;
    return map_tensors(state->output, [&](const at::Tensor&) { return outs[k++]; });
  }
};

}  // namespace

void checkpoint_module(torch::nn::Module& module, Rerun rerun, CheckpointOptions options) {
  TORCH_CHECK(rerun, "dtensor::ac::checkpoint_module: ", module.name(), ": rerun is empty");
  tp::set_forward_wrapper(
      module, Checkpointer{std::move(options.name), std::move(rerun), options.replay_collectives});
}

bool is_checkpointed(const torch::nn::Module& module) { return tp::has_forward_wrapper(module); }

void remove_checkpoint(torch::nn::Module& module) { tp::set_forward_wrapper(module, nullptr); }

}  // namespace dtensor::ac
