#include "optimizer_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <iterator>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "dtensor/optim/capturable_adamw.h"

namespace dtensor::checkpoint::detail {
namespace {

using nlohmann::json;

// CapturableAdamW has AdamW's options and state under the same names (its step is a device
// tensor): a checkpoint of either loads into the other.
enum class Kind { Adam, AdamW, SGD, CapturableAdamW };

Kind kind_of(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const optim::CapturableAdamW*>(&o) != nullptr) return Kind::CapturableAdamW;
  if (dynamic_cast<const torch::optim::AdamW*>(&o) != nullptr) return Kind::AdamW;
  if (dynamic_cast<const torch::optim::Adam*>(&o) != nullptr) return Kind::Adam;
  if (dynamic_cast<const torch::optim::SGD*>(&o) != nullptr) return Kind::SGD;
  TORCH_CHECK(false,
              "checkpoint: only torch::optim::Adam, AdamW, SGD and dtensor::optim::CapturableAdamW "
              "state can be saved and loaded; "
              "pass no optimizer to save the model alone");
}

const char* kind_name(Kind k) {
  // Indexed by Kind, in its declaration order.
  static constexpr const char* kNames[] = {"Adam", "AdamW", "SGD", "AdamW"};
  static_assert(std::size(kNames) == static_cast<size_t>(Kind::CapturableAdamW) + 1);
  return kNames[static_cast<size_t>(k)];
}

// Adam and AdamW have the same state and options fields in distinct types.
// The step count as a checkpoint holds it: a 0-d int64 tensor.
at::Tensor step_tensor(int64_t step) { return at::scalar_tensor(step, at::kLong); }
at::Tensor step_tensor(const at::Tensor& step) { return step.to(at::kCPU, at::kLong); }

template <typename State>
void adam_state_tensors(const State& s, std::vector<std::pair<std::string, at::Tensor>>& out) {
  out.emplace_back("step", step_tensor(s.step()));
  out.emplace_back("exp_avg", s.exp_avg());
  out.emplace_back("exp_avg_sq", s.exp_avg_sq());
  if (s.max_exp_avg_sq().defined()) out.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
}

template <typename State>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam_state(
    const std::map<std::string, at::Tensor>& v) {
  auto s = std::make_unique<State>();
  if constexpr (std::is_same_v<State, optim::CapturableAdamWParamState>) {
    // On the device of the moments (a DTensor's local device), as the optimizer keeps it.
    s->step(v.at("step").to(v.at("exp_avg").device(), at::kDouble));
  } else {
    s->step(v.at("step").item<int64_t>());
  }
  s->exp_avg(v.at("exp_avg"));
  s->exp_avg_sq(v.at("exp_avg_sq"));
  if (auto it = v.find("max_exp_avg_sq"); it != v.end()) s->max_exp_avg_sq(it->second);
  return s;
}

template <typename Options>
json adam_options(const Options& o) {
  return {{"lr", o.lr()},
          {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()},
          {"amsgrad", o.amsgrad()}};
}

template <typename Options>
void set_adam_options(Options& o, const json& g) {
  o.lr(g.at("lr").get<double>());
  o.betas(std::make_tuple(g.at("betas").at(0).get<double>(), g.at("betas").at(1).get<double>()));
  o.eps(g.at("eps").get<double>());
  o.weight_decay(g.at("weight_decay").get<double>());
  o.amsgrad(g.at("amsgrad").get<bool>());
}

json group_options(Kind k, const torch::optim::OptimizerOptions& o) {
  switch (k) {
    case Kind::Adam:
      return adam_options(static_cast<const torch::optim::AdamOptions&>(o));
    case Kind::AdamW:
    case Kind::CapturableAdamW:
      return adam_options(static_cast<const torch::optim::AdamWOptions&>(o));
    case Kind::SGD: {
      const auto& s = static_cast<const torch::optim::SGDOptions&>(o);
      return {{"lr", s.lr()},
              {"momentum", s.momentum()},
              {"dampening", s.dampening()},
              {"weight_decay", s.weight_decay()},
              {"nesterov", s.nesterov()}};
    }
  }
  return {};
}

void set_group_options(Kind k, torch::optim::OptimizerOptions& o, const json& g) {
  switch (k) {
    case Kind::Adam:
      set_adam_options(static_cast<torch::optim::AdamOptions&>(o), g);
      break;
    case Kind::AdamW:
    case Kind::CapturableAdamW:
      set_adam_options(static_cast<torch::optim::AdamWOptions&>(o), g);
      break;
    case Kind::SGD: {
      auto& s = static_cast<torch::optim::SGDOptions&>(o);
      s.lr(g.at("lr").get<double>());
      s.momentum(g.at("momentum").get<double>());
      s.dampening(g.at("dampening").get<double>());
      s.weight_decay(g.at("weight_decay").get<double>());
      s.nesterov(g.at("nesterov").get<bool>());
      break;
    }
  }
}

json parse(const std::string& description, const std::string& where) {
  try {
    return json::parse(description);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, where, ": the optimizer metadata is not valid JSON (", e.what(), ")");
  }
}

}  // namespace

const std::string& param_name(const ParamNames& names, const at::Tensor& param) {
  auto it = names.find(param.unsafeGetTensorImpl());
  TORCH_CHECK(it != names.end(), "checkpoint: the optimizer holds a ", param.sizes(),
              " tensor that is not a parameter of the module (build the optimizer on "
              "module.parameters())");
  return it->second;
}

std::vector<StateTensor> state_tensors(const torch::optim::Optimizer& optimizer,
                                       const ParamNames& names) {
  const Kind kind = kind_of(optimizer);
  std::vector<StateTensor> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const std::string& name = param_name(names, p);
      auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      switch (kind) {
        case Kind::Adam:
          adam_state_tensors(static_cast<const torch::optim::AdamParamState&>(*it->second),
                             tensors);
          break;
        case Kind::AdamW:
          adam_state_tensors(static_cast<const torch::optim::AdamWParamState&>(*it->second),
                             tensors);
          break;
        case Kind::CapturableAdamW:
          adam_state_tensors(static_cast<const optim::CapturableAdamWParamState&>(*it->second),
                             tensors);
          break;
        case Kind::SGD: {
          const auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
          if (s.momentum_buffer().defined())
            tensors.emplace_back("momentum_buffer", s.momentum_buffer());
          break;
        }
      }
      for (auto& [key, t] : tensors) out.push_back({name, key, t});
    }
  }
  return out;
}

std::string describe(const torch::optim::Optimizer& optimizer, const ParamNames& names) {
  const Kind kind = kind_of(optimizer);
  json groups = json::array();
  for (const auto& group : optimizer.param_groups()) {
    json g = group_options(kind, group.options());
    json params = json::array();
    for (const auto& p : group.params()) params.push_back(param_name(names, p));
    g["params"] = std::move(params);
    groups.push_back(std::move(g));
  }
  return json{{"type", kind_name(kind)}, {"param_groups", std::move(groups)}}.dump();
}

StateKeys state_keys(const torch::optim::Optimizer& optimizer) {
  if (kind_of(optimizer) == Kind::SGD) return {{"momentum_buffer"}, {}};
  return {{"step", "exp_avg", "exp_avg_sq"}, {"max_exp_avg_sq"}};
}

void check_description(const torch::optim::Optimizer& optimizer, const ParamNames& names,
                       const std::string& description, const std::string& where) {
  const json d = parse(description, where);
  const std::string type = kind_name(kind_of(optimizer));
  try {
    const std::string saved = d.at("type").get<std::string>();
    TORCH_CHECK(saved == type, where, " holds ", saved,
                " optimizer state; it cannot be loaded into ", type);
    const json& groups = d.at("param_groups");
    const auto& current = optimizer.param_groups();
    TORCH_CHECK(groups.size() == current.size(), where, " has ", groups.size(),
                " optimizer param groups; this optimizer has ", current.size());
    for (size_t i = 0; i < current.size(); ++i) {
      std::vector<std::string> now;
      for (const auto& p : current[i].params()) now.push_back(param_name(names, p));
      const auto saved_params = groups[i].at("params").get<std::vector<std::string>>();
      TORCH_CHECK(saved_params == now, where, ": optimizer param group ", i, " held [",
                  c10::Join(", ", saved_params), "] when saved; now it holds [",
                  c10::Join(", ", now), "]");
      // Every option must be present and well-typed before load_checkpoint changes anything.
      set_group_options(kind_of(optimizer), *current[i].options().clone(), groups[i]);
    }
  } catch (const json::exception& e) {
    TORCH_CHECK(false, where, ": malformed optimizer metadata (", e.what(), ")");
  }
}

std::unique_ptr<torch::optim::OptimizerParamState> make_param_state(
    const torch::optim::Optimizer& optimizer, const std::map<std::string, at::Tensor>& values) {
  switch (kind_of(optimizer)) {
    case Kind::Adam:
      return make_adam_state<torch::optim::AdamParamState>(values);
    case Kind::AdamW:
      return make_adam_state<torch::optim::AdamWParamState>(values);
    case Kind::CapturableAdamW:
      return make_adam_state<optim::CapturableAdamWParamState>(values);
    case Kind::SGD: {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(values.at("momentum_buffer"));
      return s;
    }
  }
  return nullptr;
}

void apply_group_options(torch::optim::Optimizer& optimizer, const std::string& description) {
  const Kind kind = kind_of(optimizer);
  const json d = json::parse(description);  // checked by check_description
  auto& groups = optimizer.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    set_group_options(kind, groups[i].options(), d.at("param_groups").at(i));
  }
}

}  // namespace dtensor::checkpoint::detail
