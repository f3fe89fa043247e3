#pragma once
// What a checkpoint keeps of an optimizer (torch::optim's Adam, AdamW, SGD, and
// dtensor::optim::CapturableAdamW, saved as AdamW): per-parameter state
// tensors keyed by parameter name (not by position, so a model whose parameters are created
// in another order still matches), and the param groups' options.
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace dtensor::checkpoint::detail {

// A parameter's TensorImpl -> its name in the module.
using ParamNames = std::unordered_map<const void*, std::string>;

// The parameter's name, or an error saying the optimizer holds a tensor the module lacks.
const std::string& param_name(const ParamNames& names, const at::Tensor& param);

struct StateTensor {
  std::string param;  // parameter name
  std::string key;    // "exp_avg", ...; "step" is a 0-d int64 tensor
  at::Tensor value;   // shaped and placed like the parameter (except "step")
};
// The state of every parameter that has some, in param-group order.
std::vector<StateTensor> state_tensors(const torch::optim::Optimizer& optimizer,
                                       const ParamNames& names);

// {"type": "AdamW", "param_groups": [{"params": [names], "lr": ..., ...}]} as JSON.
std::string describe(const torch::optim::Optimizer& optimizer, const ParamNames& names);

// Keys a parameter's state has for this optimizer type.
struct StateKeys {
  std::vector<std::string> required;
  std::vector<std::string> optional;
};
StateKeys state_keys(const torch::optim::Optimizer& optimizer);

// Checks a description read from `where` against `optimizer`: same type, same number of
// param groups, each holding the same parameters (by name, in order). Throws otherwise.
void check_description(const torch::optim::Optimizer& optimizer, const ParamNames& names,
                       const std::string& description, const std::string& where);

// A new state object holding `values` (by key, "step" 0-d int64).
std::unique_ptr<torch::optim::OptimizerParamState> make_param_state(
    const torch::optim::Optimizer& optimizer, const std::map<std::string, at::Tensor>& values);

// Sets each param group's options (lr, betas, ...) to those in the description.
void apply_group_options(torch::optim::Optimizer& optimizer, const std::string& description);

}  // namespace dtensor::checkpoint::detail
