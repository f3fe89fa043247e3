// Hugging Face checkpoints out: config.json and model.safetensors as save_pretrained
// writes them, from a model at any TP degree, FSDP-sharded (fsdp::fully_shard) or not.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/checkpoint/rank0_outcome.h"
#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/util/atomic_file.h"
#include "dtensor/models/hf_experts.h"
#include "hf_families.h"
#include "parameter_schema.h"

namespace dtensor::models {

namespace {

namespace fs = std::filesystem;
namespace safetensors = checkpoint::safetensors;

std::string torch_dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    case at::kDouble:
      return "float64";
    default:
      TORCH_CHECK(false, "save_hf: dtype ", t,
                  " is not a Hugging Face weight dtype; use float32, bfloat16, float16 or float64");
  }
}

// Our interleaved rotary pairs back to HF's rotate-half rows, per head.
at::Tensor rotate_half_rows(const at::Tensor& w, int64_t head_dim) {
  const int64_t n = w.size(0);
  return w.reshape({n / head_dim, head_dim / 2, 2, -1}).transpose(1, 2).reshape(w.sizes());
}

}  // namespace

void save_hf(const std::string& dir, const TransformerImpl& model, const HfSaveOptions& options) {
  const DecoderConfig& config = model.config();
  struct Item {
    std::string hf_name;
    at::Tensor param;
    bool rotary;
  };
  std::vector<Item> items;
  std::vector<safetensors::Writer::Entry> entries;
  c10::ScalarType model_dtype = at::kFloat;
  // A sparse layer's stacked experts, written as the family stores them (hf_expert_tensors).
  std::map<int64_t, std::map<std::string, at::Tensor>> experts;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const std::string& name = p.key();
    model_dtype = p.value().scalar_type();
    const at::Tensor& t = p.value();
    const auto row = detail::find_parameter_row(name);
    if (row && detail::is_expert_role(row->row->role)) {
      experts[row->layer][name.substr(name.rfind('.') + 1)] = t;
      continue;
    }
    items.push_back({hf_parameter_name(name, config), t, detail::has_rotary_rows(name)});
  }
  // The experts as ExpertWeights from what `get` makes of each parameter.
  auto expert_weights = [](const std::map<std::string, at::Tensor>& params, const auto& get) {
    ExpertWeights w;
    at::Tensor* members[] = {&w.w1, &w.w2, &w.w3, &w.b1, &w.b2, &w.b3};
    for (int i = 0; i < 6; ++i) {
      const auto it = params.find(expert_param_name(static_cast<ExpertParam>(i)));
      if (it != params.end()) *members[i] = get(it->second);
    }
    return w;
  };
  const c10::ScalarType dtype = options.dtype.value_or(model_dtype);
  // Every rank refuses an unsupported dtype or family before any collective.
  torch_dtype_name(dtype);
  const detail::HfFamily* family = &detail::hf_family_for(config);
  if (options.architecture) {
    family = nullptr;
    for (const auto& f : detail::hf_families())
      if (*options.architecture == f.architecture) family = &f;
    TORCH_CHECK(family, "save_hf: architecture \"", *options.architecture,
                "\" is not one the saver writes");
  }
  for (const auto& item : items) {
    entries.push_back({item.hf_name, dtype, item.param.sizes().vec()});
  }
  const HfExpertLayout* layout = experts.empty() ? nullptr : family->experts;
  TORCH_CHECK(experts.empty() || layout, "save_hf: architecture ", family->architecture,
              " has no experts to hold the model's");
  for (const auto& [layer, params] : experts) {
    // Shapes only: the global shapes on the meta device.
    const ExpertWeights shapes = expert_weights(params, [](const at::Tensor& t) {
      return at::empty(t.sizes(), at::TensorOptions().device(at::kMeta));
    });
    for (const auto& [name, t] : hf_expert_tensors(*layout, layer, shapes))
      entries.push_back({name, dtype, t.sizes().vec()});
  }

  const bool writes = checkpoint::detail::global_rank() == 0;
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  std::unique_ptr<safetensors::Writer> writer;
  std::exception_ptr error;
  if (writes) {
    try {
      fs::create_directories(dir);
      writer = std::make_unique<safetensors::Writer>(path, entries,
                                                     safetensors::Metadata{{"format", "pt"}});
    } catch (...) {
      error = std::current_exception();
    }
  }
  at::NoGradGuard no_grad;
  for (const auto& item : items) {
    const at::Tensor& t = item.param;
    if (!is_dtensor(t) && !writes) continue;
    at::Tensor full = is_dtensor(t) ? full_tensor(t.detach()) : t.detach();
    if (!writes || error) continue;
    try {
      at::Tensor w = full.cpu().to(dtype);
      if (item.rotary) w = rotate_half_rows(w, config.head_dim());
      writer->write(w.contiguous());
    } catch (...) {
      error = std::current_exception();
    }
  }
  for (const auto& [layer, params] : experts) {
    // Every rank gathers (FSDP's and TP's shards), rank 0 writes.
    const ExpertWeights whole = expert_weights(params, [&](const at::Tensor& t) {
      const at::Tensor full = is_dtensor(t) ? full_tensor(t.detach()) : t.detach();
      return writes ? full.cpu().to(dtype) : full;
    });
    if (!writes || error) continue;
    try {
      for (const auto& [name, t] : hf_expert_tensors(*layout, layer, whole))
        writer->write(t.contiguous());
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (writes && !error) {
    try {
      writer->finish({{"format", "pt"}});
      util::write_file_atomically((fs::path(dir) / "config.json").string(),
                                  detail::hf_config_json(config, *family, torch_dtype_name(dtype)),
                                  "save_hf");
    } catch (...) {
      error = std::current_exception();
    }
  }
  writer.reset();
  checkpoint::detail::share_rank0_outcome(error, "save_hf('" + dir + "')");
}

}  // namespace dtensor::models
