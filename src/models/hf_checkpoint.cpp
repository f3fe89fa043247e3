// Hugging Face checkpoints in: config.json to DecoderConfig, HF names to ours, q/k rows from
// rotate-half order to interleaved pairs, and each rank's slices read straight from the files.
#include "dtensor/models/hf_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <vector>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/models/hf_experts.h"
#include "dtensor/models/meta_init.h"
#include "hf_families.h"
#include "meta_construction.h"
#include "parameter_schema.h"

namespace dtensor::models {

namespace {

namespace fs = std::filesystem;
namespace safetensors = checkpoint::safetensors;
using nlohmann::json;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// `text` as JSON; `source` (a path) names it in the error.
json parse_json(const std::string& text, const std::string& what, const std::string& source) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, what, " '", source, "' is not valid JSON: ", e.what());
  }
}

json read_json(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open ", what, " '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_json(ss.str(), what, path);
}

// The checkpoint's files, opened on first use, and which file holds each tensor.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir) : dir_(dir) {
    const fs::path index = fs::path(dir) / kIndexFile;
    const fs::path single = fs::path(dir) / kSingleFile;
    if (fs::exists(index)) {
      index_path_ = index.string();
      const json j = read_json(index_path_, "checkpoint index");
      const auto map = j.find("weight_map");
      TORCH_CHECK(map != j.end() && map->is_object(), "checkpoint index '", index_path_,
                  "' has no \"weight_map\" object {tensor name: file}");
      for (const auto& [name, file] : map->items()) {
        TORCH_CHECK(file.is_string(), "checkpoint index '", index_path_, "': the file of \"", name,
                    "\" is not a string");
        file_of_[name] = file.get<std::string>();
      }
    } else {
      TORCH_CHECK(fs::exists(single), "Hugging Face checkpoint '", dir, "' has neither ",
                  kSingleFile, " nor ", kIndexFile,
                  " (a directory written by save_pretrained has one of them)");
      for (const auto& info : open(kSingleFile, "").tensors()) file_of_[info.name] = kSingleFile;
    }
  }

  const std::map<std::string, std::string>& file_of() const { return file_of_; }

  // The checkpoint as hf_experts.h reads it.
  HfTensorSource source() {
    return {[this](const std::string& name) { return file_of_.count(name) > 0; },
            [this](const std::string& name) { return locate(name); }};
  }
  int64_t files_opened() const { return static_cast<int64_t>(files_.size()); }

  // Where `name` is; throws naming the file (or index) when it is absent or unreadable.
  std::pair<const safetensors::File*, const safetensors::TensorInfo*> locate(
      const std::string& name) {
    const auto it = file_of_.find(name);
    TORCH_CHECK(it != file_of_.end(), "Hugging Face checkpoint '", dir_, "': tensor \"", name,
                "\" is missing from ", index_path_.empty() ? kSingleFile : index_path_);
    const safetensors::File& f = open(it->second, name);
    const safetensors::TensorInfo* info = f.find(name);
    TORCH_CHECK(info != nullptr, "safetensors file '", f.path(), "' has no tensor \"", name,
                "\", although ", index_path_, " lists it there");
    return {&f, info};
  }

 private:
  const safetensors::File& open(const std::string& file, const std::string& tensor) {
    auto& slot = files_[file];
    if (slot) return *slot;
    const std::string path = (fs::path(dir_) / file).string();
    const std::string why =
        tensor.empty() ? "" : " (it holds tensor \"" + tensor + "\" per " + index_path_ + ")";
    TORCH_CHECK(fs::exists(path), "Hugging Face checkpoint '", dir_, "': shard '", path,
                "' is missing", why);
    try {
      slot = std::make_unique<safetensors::File>(path);
    } catch (const c10::Error& e) {
      files_.erase(file);
      TORCH_CHECK(false, e.msg(), why);
    }
    return *slot;
  }

  std::string dir_;
  std::string index_path_;
  std::map<std::string, std::string> file_of_;
  std::map<std::string, std::unique_ptr<safetensors::File>> files_;
};

// HF stores each head's q/k rows as [all first halves, all second halves] (rotate-half); our
// rotary pairs neighbours. rows: a block of whole heads.
at::Tensor interleave_rotary_rows(const at::Tensor& rows, int64_t head_dim) {
  const int64_t n = rows.size(0);
  return rows.reshape({n / head_dim, 2, head_dim / 2, -1}).transpose(1, 2).reshape(rows.sizes());
}

// The HfConfig of a parsed config.json; `source` names it in errors.
HfConfig hf_config_of(const json& j, const std::string& source) {
  const detail::HfConfigRead read = detail::parse_hf_config(j, source);
  HfConfig out;
  out.config = read.config;
  out.dtype = read.dtype;
  out.architecture = read.family->architecture;
  return out;
}

}  // namespace

HfConfig read_hf_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  return hf_config_of(read_json(path, "Hugging Face config"), path);
}

HfConfig hf_config_from_json(const std::string& text, const std::string& source) {
  return hf_config_of(parse_json(text, "Hugging Face config", source), source);
}

namespace {

// What this rank reads of `param`: the block [offset, offset + size) of its whole shape (its
// shard under TP or FSDP), its local tensor and the device the part goes to (the CPU for a meta
// parameter's); nullopt when the rank holds none of it (outside its mesh, or with `skip_meta` a
// meta parameter: another pipeline stage's).
struct RankPart {
  std::vector<int64_t> offset, size;
  at::Tensor local;
  c10::Device device;
};
std::optional<RankPart> rank_part(const at::Tensor& param, bool skip_meta) {
  RankPart out{std::vector<int64_t>(static_cast<size_t>(param.dim()), 0), param.sizes().vec(),
               param, c10::kCPU};
  if (is_dtensor(param)) {
    const DTensorSpec& spec = spec_of(param);
    if (!spec.mesh().contains_this_rank()) return std::nullopt;
    const LocalShard shard = spec.local_shard();
    out.offset = shard.offset;
    out.size = shard.shape;
    out.local = local_tensor(param);
    out.device = spec.mesh().device();
  }
  if (skip_meta && out.local.is_meta()) return std::nullopt;
  if (!out.local.is_meta()) out.device = out.local.device();
  return out;
}

// This rank's part of a sparse layer's stacked expert parameter `name` (its shard of the whole
// stacked shape), read from the family's tensors (per expert, stacked, or MXFP4 dequantised),
// handed to `take` as read_hf_parts hands the others.
void read_experts(
    const HfTensorSource& source, const DecoderConfig& config, const std::string& name,
    int64_t layer, const at::Tensor& param,
    const std::function<void(const std::string&, const at::Tensor&, at::Tensor)>& take,
    bool skip_meta, HfLoadStats& stats) {
  const auto part_of = rank_part(param, skip_meta);
  if (!part_of) return;
  const auto& [offset, size, local, device] = *part_of;
  const std::string sizes_note =
      c10::str("num_experts=", config.moe->options.num_experts, ", expert intermediate size ",
               config.moe->expert_hidden_dim, ", hidden_size=", config.dim);
  const ExpertParam which = expert_param(name.substr(name.rfind('.') + 1));
  at::Tensor part =
      read_expert_part(source, detail::hf_expert_layout_for(config), layer, which, param.sizes(),
                       offset, size, local.scalar_type(), sizes_note, &stats.bytes_read);
  stats.checkpoint_bytes += static_cast<uint64_t>(param.numel()) * param.element_size();
  ++stats.tensors;
  take(name, param, part.to(local.options().device(device)));
}

// Reads this rank's part of every parameter of `model` (in the parameter's dtype, on its device;
// the CPU for a meta parameter) and hands it to take(name, parameter, part) in order, after
// checking every name, shape and dtype against the files. Reads one tensor at a time: what take
// keeps is all it holds on to.
HfLoadStats read_hf_parts(
    const std::string& dir, TransformerImpl& model,
    const std::function<void(const std::string&, const at::Tensor&, at::Tensor)>& take,
    bool skip_meta = false) {
  const DecoderConfig& config = model.config();
  Checkpoint ckpt(dir);
  HfLoadStats stats;

  const HfTensorSource source = ckpt.source();
  // Names the model has no place for mean another architecture (biases, ...): refuse them.
  std::set<std::string> used;
  std::set<int64_t> expert_layers;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const auto row = detail::find_parameter_row(p.key());
    if (row && detail::is_expert_role(row->row->role))
      expert_layers.insert(row->layer);
    else
      used.insert(hf_parameter_name(p.key(), config));
  }
  for (const int64_t layer : expert_layers) {
    const HfExpertLayout& layout = detail::hf_expert_layout_for(config);
    for (const std::string& name :
         hf_expert_tensor_names(source, layout, layer, config.moe->options.num_experts,
                                config.moe->options.expert_bias))
      used.insert(name);
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, file] : ckpt.file_of()) {
    if (used.count(name) || name.ends_with("rotary_emb.inv_freq")) continue;
    if (name == "lm_head.weight" && config.tie_embeddings) continue;  // tied: the embedding
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    if (unexpected.size() > 5) unexpected.resize(5);
    TORCH_CHECK(false, "Hugging Face checkpoint '", dir, "' holds tensors the model has no place ",
                "for (nothing loaded): ", c10::Join(", ", unexpected));
  }

  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const std::string& name = p.key();
    const at::Tensor& param = p.value();
    const auto row = detail::find_parameter_row(name);
    if (row && detail::is_expert_role(row->row->role)) {
      read_experts(source, config, name, row->layer, param, take, skip_meta, stats);
      continue;
    }
    const std::string hf = hf_parameter_name(name, config);
    const auto [file, info] = ckpt.locate(hf);
    const std::string what = "safetensors file '" + file->path() + "', tensor \"" + hf + "\"";
    TORCH_CHECK(at::isFloatingType(info->dtype), what, ": dtype ", info->dtype,
                " is not a floating type");
    TORCH_CHECK(
        c10::IntArrayRef(info->shape) == param.sizes(), what, ": shape ",
        c10::IntArrayRef(info->shape), " disagrees with config.json, which gives ", param.sizes(),
        " (hidden_size=", config.dim, ", intermediate_size=", config.hidden_dim(),
        ", num_attention_heads=", config.n_heads, ", num_key_value_heads=", config.kv_heads(),
        ", head_dim=", config.head_dim(), ", vocab_size=", config.vocab_size, ")");
    stats.checkpoint_bytes += info->nbytes();

    const auto part_of = rank_part(param, skip_meta);
    if (!part_of) continue;
    const auto& [offset, size, local, device] = *part_of;
    at::Tensor part = file->slice(*info, offset, size);
    stats.bytes_read += part.nbytes();
    ++stats.tensors;
    if (detail::has_rotary_rows(name)) {
      const int64_t hd = config.head_dim();
      TORCH_CHECK(offset[0] % hd == 0 && size[0] % hd == 0, what, ": this rank's rows [", offset[0],
                  ", ", offset[0] + size[0], ") do not hold whole heads of ", hd,
                  " rows, which the rotary row order needs");
      part = interleave_rotary_rows(part, hd);
    }
    // slice() and the row permutation give fresh tensors: a cast is the only copy needed.
    take(name, param, part.to(local.options().device(device)));
  }
  stats.files = ckpt.files_opened();
  return stats;
}

}  // namespace

HfLoadStats load_hf_weights(const std::string& dir, TransformerImpl& model) {
  // Everything is read and checked before the first parameter changes.
  std::vector<std::pair<at::Tensor, at::Tensor>> items;  // parameter, this rank's part
  const HfLoadStats stats = read_hf_parts(
      dir, model,
      [&](const std::string&, const at::Tensor& param, at::Tensor part) {
        items.emplace_back(param, std::move(part));
      },
      /*skip_meta=*/true);
  at::NoGradGuard no_grad;
  for (auto& [param, part] : items) {
    (is_dtensor(param) ? local_tensor(param) : param).copy_(part);
  }
  return stats;
}

HfModel load_hf(const std::string& dir, const std::optional<DeviceMesh>& mesh,
                const HfLoadOptions& options) {
  const HfConfig hf = read_hf_config(dir);
  HfModel out;
  out.config = hf.config;
  if (options.max_seq_len) out.config.max_seq_len = *options.max_seq_len;
  // Built on the meta device and cut by the plan before any memory is allocated: each part read
  // from the files becomes the parameter's storage, so a rank holds only its own parameters.
  Transformer model = meta_transformer(out.config);
  model->to(options.dtype.value_or(hf.dtype));
  if (mesh) apply_tensor_parallel(*model, *mesh, options.tp);
  std::map<std::string, at::Tensor> parts;
  out.stats =
      read_hf_parts(dir, *model, [&](const std::string& name, const at::Tensor&, at::Tensor part) {
        parts.emplace(name, std::move(part));
      });
  detail::materialize_parameters(
      *model, [&](const std::string& name, const at::Tensor& local, c10::Device device) {
        const auto it = parts.find(name);
        // A rank outside the mesh holds empty parts and reads nothing.
        if (it == parts.end() && local.numel() == 0)
          return at::empty(local.sizes(), local.options().device(device));
        TORCH_CHECK(it != parts.end(), "load_hf: no part of parameter \"", name, "\" was read");
        at::Tensor part = std::move(it->second);
        parts.erase(it);
        return part;
      });
  out.model = model;
  return out;
}

}  // namespace dtensor::models
