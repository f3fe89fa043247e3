// Hugging Face Llama checkpoints out: config.json and model.safetensors as save_pretrained
// writes them, from a model at any TP degree.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/checkpoint/rank0_outcome.h"

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
      TORCH_CHECK(false, "save_hf_llama: dtype ", t,
                  " is not a Hugging Face weight dtype; use float32, bfloat16, float16 or float64");
  }
}

// transformers 4's form (rope_theta and rope_scaling at the top level, torch_dtype), which
// transformers 5 reads as well and real Llama 3.1 checkpoints use.
std::string config_json(const LlamaConfig& c, c10::ScalarType dtype) {
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.dim;
  j["intermediate_size"] = c.hidden_dim();
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.kv_heads();
  j["head_dim"] = c.head_dim();
  j["max_position_embeddings"] = c.max_seq_len;
  j["rms_norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling) {
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", c.rope_scaling->factor},
        {"low_freq_factor", c.rope_scaling->low_freq_factor},
        {"high_freq_factor", c.rope_scaling->high_freq_factor},
        {"original_max_position_embeddings", c.rope_scaling->original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["torch_dtype"] = torch_dtype_name(dtype);
  j["vocab_size"] = c.vocab_size;
  return j.dump(2) + "\n";
}

// Our interleaved rotary pairs back to HF's rotate-half rows, per head.
at::Tensor rotate_half_rows(const at::Tensor& w, int64_t head_dim) {
  const int64_t n = w.size(0);
  return w.reshape({n / head_dim, head_dim / 2, 2, -1}).transpose(1, 2).reshape(w.sizes());
}

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    TORCH_CHECK(out.good(), "save_hf_llama: writing '", tmp, "' failed");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TORCH_CHECK(!ec, "save_hf_llama: renaming '", tmp, "' to '", path, "' failed: ", ec.message());
}

}  // namespace

void save_hf_llama(const std::string& dir, const TransformerImpl& model,
                   const HfSaveOptions& options) {
  const LlamaConfig& config = model.config();
  struct Item {
    std::string hf_name;
    at::Tensor param;
    bool rotary;
  };
  std::vector<Item> items;
  std::vector<safetensors::Writer::Entry> entries;
  c10::ScalarType model_dtype = at::kFloat;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const std::string& name = p.key();
    model_dtype = p.value().scalar_type();
    const bool rotary =
        name.ends_with("attention.wq.weight") || name.ends_with("attention.wk.weight");
    items.push_back({hf_parameter_name(name), p.value(), rotary});
  }
  const c10::ScalarType dtype = options.dtype.value_or(model_dtype);
  torch_dtype_name(dtype);  // every rank refuses an unsupported dtype before any collective
  for (const auto& item : items) entries.push_back({item.hf_name, dtype, item.param.sizes().vec()});

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
  if (writes && !error) {
    try {
      writer->finish({{"format", "pt"}});
      write_text_atomically((fs::path(dir) / "config.json").string(), config_json(config, dtype));
    } catch (...) {
      error = std::current_exception();
    }
  }
  writer.reset();
  checkpoint::detail::share_rank0_outcome(error, "save_hf_llama('" + dir + "')");
}

}  // namespace dtensor::models
