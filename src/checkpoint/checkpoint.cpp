#include "dtensor/checkpoint/checkpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "dtensor/checkpoint/crc32c.h"
#include "dtensor/checkpoint/rank0_outcome.h"
#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/comm/process_group.h"
#include "dtensor/core/api.h"
#include "dtensor/core/dtensor_impl.h"
#include "dtensor/mesh/device_mesh.h"
#include "optimizer_state.h"

namespace dtensor::checkpoint {
namespace {

namespace keys = checkpoint_keys;
using nlohmann::json;

constexpr const char* kFormatName = "dtensor-checkpoint";
constexpr const char* kChecksumAlgorithm = "crc32c";
constexpr const char* kOptimPrefix = "optim.state.";
constexpr size_t kListLimit = 20;  // names listed per error category

std::string optim_name(const std::string& param, const std::string& key) {
  return kOptimPrefix + param + "." + key;
}

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08" PRIx32, v);
  return buf;
}

// PyTorch's repr ("Shard(dim=0)", "Replicate()", "Partial(sum)"), mesh dims joined by ", ".
std::string placements_string(const Placements& ps) {
  std::vector<std::string> each;
  for (const auto& p : ps) each.push_back(p.repr());
  return c10::Join(", ", each);
}

// The size of the mesh's "tp" dim (mesh_for_role's rule); a mesh with names but no "tp" (FSDP's
// "dp") has none: 1; an unnamed mesh of several dims counts all its ranks.
int64_t tp_degree_of(const DeviceMesh& mesh) {
  if (const auto tp = mesh_for_role(mesh, "tp")) return tp->size();
  return mesh.has_dim_names() ? 1 : mesh.size();
}

detail::ParamNames param_names(const torch::nn::Module& module) {
  detail::ParamNames names;
  for (const auto& p : module.named_parameters()) {
    if (p.value().defined()) names.emplace(p.value().unsafeGetTensorImpl(), p.key());
  }
  return names;
}

std::string join_limited(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size() && i < kListLimit; ++i) s += "\n    " + items[i];
  if (items.size() > kListLimit) {
    s += "\n    ... and " + std::to_string(items.size() - kListLimit) + " more";
  }
  return s;
}

// The first few names on one line, for errors that show what each side holds.
std::string join_few(const std::vector<std::string>& items) {
  constexpr size_t kFew = 5;
  std::vector<std::string> few(items.begin(), items.begin() + std::min(items.size(), kFew));
  return c10::Join(", ", few) + (items.size() > kFew ? ", ..." : "");
}

std::string shape_string(c10::IntArrayRef s) { return c10::str(s); }

int64_t parse_int(const std::map<std::string, std::string>& m, const char* key, int64_t dflt,
                  const std::string& where) {
  auto it = m.find(key);
  if (it == m.end()) return dflt;
  try {
    size_t used = 0;
    const int64_t v = std::stoll(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {
  }
  TORCH_CHECK(false, where, ": metadata \"", key, "\" is not an integer: \"", it->second, "\"");
}

// What the header checksum covers: every metadata entry but the checksum itself, and each
// tensor's name, dtype, shape and offsets (all a load reads from the header), as canonical
// JSON, so that the writer and a reader compute it alike from the values, not the bytes.
std::string header_checksum(const safetensors::Metadata& metadata,
                            const std::vector<safetensors::TensorInfo>& tensors) {
  json entries = json::object();  // keys sorted
  for (const auto& [k, v] : metadata) {
    if (k != keys::kHeaderChecksum) entries[k] = v;
  }
  json table = json::object();
  for (const auto& t : tensors) {
    table[t.name] = json::array({safetensors::dtype_name(t.dtype), t.shape, t.begin, t.end});
  }
  const std::string text = json::array({entries, table}).dump();
  return hex32(crc32c(text.data(), text.size()));
}

// The checkpoint format version of the file (0: a plain safetensors file), after checking the
// header checksum of files we wrote. Refuses files whose metadata cannot be checked.
int64_t checked_format_version(const safetensors::File& file, const std::string& where) {
  const auto& m = file.metadata();
  auto it = m.find(keys::kCheckpointFormat);
  if (it == m.end()) {
    auto format = m.find(keys::kFormat);
    TORCH_CHECK(format == m.end() || format->second != kFormatName, where,
                " has checkpoint format version 1, whose metadata (step, config, optimizer "
                "settings, placements) has no checksum: damage to it could load unnoticed, so "
                "this build refuses the file. Its tensors can still be read with "
                "safetensors::load_file (their CRC-32C values are in its \"",
                keys::kChecksums, "\" entry); save them again with save_checkpoint");
    // Our files always hold all of these, so one damaged entry name cannot make a checkpoint
    // pass for a plain file (which would load without checksums).
    for (const char* key : {keys::kFormatVersion, keys::kHeaderChecksum, keys::kChecksums,
                            keys::kChecksumAlgorithm, keys::kPlacements}) {
      TORCH_CHECK(m.count(key) == 0, where, " has the checkpoint metadata entry \"", key,
                  "\" but no \"", keys::kCheckpointFormat,
                  "\" entry: the header is damaged (or the file was not written by "
                  "save_checkpoint); restore it from a copy or load an older checkpoint");
    }
    return 0;
  }
  TORCH_CHECK(it->second == kFormatName, where, " has ", keys::kCheckpointFormat, " \"", it->second,
              "\", expected \"", kFormatName, "\"");
  const int64_t version = parse_int(m, keys::kFormatVersion, 0, where);
  TORCH_CHECK(version == kCheckpointFormatVersion, where, " has checkpoint format version ",
              version, "; this build reads version ", kCheckpointFormatVersion);
  auto recorded = m.find(keys::kHeaderChecksum);
  TORCH_CHECK(recorded != m.end(), where, " has no header checksum (\"", keys::kHeaderChecksum,
              "\" entry): the header is damaged; restore it from a copy or load an older "
              "checkpoint");
  const std::string actual = header_checksum(m, file.tensors());
  TORCH_CHECK(actual == recorded->second, where, ": the header checksum does not match (CRC-32C ",
              actual, ", recorded ", recorded->second,
              "): its metadata (step, config, optimizer settings, ...) or tensor table is "
              "damaged; restore it from a copy or load an older checkpoint");
  return version;
}

CheckpointMetadata parse_metadata(const safetensors::File& file) {
  const std::string where = "checkpoint '" + file.path() + "'";
  const auto& m = file.metadata();
  CheckpointMetadata meta;
  meta.entries = m;
  meta.format_version = checked_format_version(file, where);
  if (auto it = m.find(keys::kConfig); it != m.end()) meta.config = it->second;
  meta.step = parse_int(m, keys::kStep, 0, where);
  meta.tp_degree = parse_int(m, keys::kTpDegree, 1, where);
  meta.world_size = parse_int(m, keys::kWorldSize, 1, where);
  return meta;
}

// name -> expected CRC-32C; empty when the file has no checksums (not written by us).
std::map<std::string, std::string> parse_checksums(const safetensors::File& file) {
  const std::string where = "checkpoint '" + file.path() + "'";
  const auto& m = file.metadata();
  auto it = m.find(keys::kChecksums);
  if (it == m.end()) return {};
  auto alg = m.find(keys::kChecksumAlgorithm);
  TORCH_CHECK(alg != m.end() && alg->second == kChecksumAlgorithm, where,
              " uses checksum algorithm \"", alg == m.end() ? "" : alg->second,
              "\"; this build knows \"", kChecksumAlgorithm, "\"");
  try {
    return json::parse(it->second).get<std::map<std::string, std::string>>();
  } catch (const json::exception& e) {
    TORCH_CHECK(false, where, ": the checksums metadata is not a JSON object of strings (",
                e.what(), ")");
  }
}

void verify_tensor(const safetensors::File& file, const safetensors::TensorInfo& info,
                   const std::map<std::string, std::string>& checksums) {
  auto it = checksums.find(info.name);
  TORCH_CHECK(it != checksums.end(), "checkpoint '", file.path(), "': tensor \"", info.name,
              "\" has no checksum in the metadata (the file is damaged)");
  const auto b = file.bytes(info);
  const std::string actual = hex32(crc32c(b.data(), b.size()));
  TORCH_CHECK(actual == it->second, "checkpoint '", file.path(), "': tensor \"", info.name,
              "\" is corrupt: its CRC-32C is ", actual, " but the checkpoint recorded ",
              it->second);
}

// This rank's part of `info` for a tensor laid out like `like`, as a new tensor with the local
// tensor's dtype and device. Undefined when this rank holds no part (not in the mesh).
at::Tensor local_part(const safetensors::File& file, const safetensors::TensorInfo& info,
                      const at::Tensor& like) {
  at::Tensor part = file.view(info);
  at::Tensor local = like;
  if (is_dtensor(like)) {
    const DTensorSpec& spec = *dtensor_impl(like)->spec();
    TORCH_CHECK(!spec.has_partial(), "load_checkpoint: \"", info.name, "\" has placements ",
                to_string(spec.placements()),
                "; a tensor with Partial placements cannot receive a checkpoint");
    if (!spec.mesh().contains_this_rank()) return {};
    const LocalShard shard = spec.local_shard();
    for (int64_t d = 0; d < part.dim(); ++d) {
      if (shard.shape[d] != part.size(d)) part = part.narrow(d, shard.offset[d], shard.shape[d]);
    }
    local = local_tensor(like);
  }
  return part.to(local.options(), /*non_blocking=*/false, /*copy=*/true);
}

// Wraps a local part like `like` (same mesh and placements) when `like` is a DTensor.
at::Tensor wrap_like(at::Tensor local, const at::Tensor& like) {
  if (!is_dtensor(like)) return local;
  return make_dtensor(std::move(local), dtensor_impl(like)->spec());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// save

void save_checkpoint(const std::string& path, const torch::nn::Module& module,
                     torch::optim::Optimizer* optimizer, const SaveOptions& options) {
  at::NoGradGuard no_grad;
  struct Item {
    std::string name;
    at::Tensor tensor;
  };
  std::vector<Item> items;
  std::set<std::string> names;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    TORCH_CHECK(names.insert(name).second, "save_checkpoint: two tensors are named \"", name,
                "\" (an optimizer state name collides with a parameter?)");
    items.push_back({name, t});
  };
  for (const auto& p : module.named_parameters()) {
    if (p.value().defined()) add(p.key(), p.value());
  }
  if (options.include_buffers) {
    for (const auto& b : module.named_buffers()) {
      if (b.value().defined()) add(b.key(), b.value());
    }
  }
  std::string optimizer_description;
  if (optimizer != nullptr) {
    const auto pnames = param_names(module);
    for (auto& s : detail::state_tensors(*optimizer, pnames))
      add(optim_name(s.param, s.key), s.value);
    optimizer_description = detail::describe(*optimizer, pnames);
  }

  // Everything that can fail on every rank alike is checked before the first collective.
  std::vector<safetensors::Writer::Entry> entries;
  json placements = json::object();
  std::map<std::string, std::string> checksums;
  std::optional<DeviceMesh> first_mesh;
  for (const auto& item : items) {
    try {
      safetensors::dtype_name(item.tensor.scalar_type());
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "save_checkpoint: \"", item.name, "\": ", e.what_without_backtrace());
    }
    entries.push_back({item.name, item.tensor.scalar_type(), item.tensor.sizes().vec()});
    checksums[item.name] = hex32(0);  // fixed-width placeholder, filled in as tensors are written
    if (is_dtensor(item.tensor)) {
      const DTensorSpec& spec = *dtensor_impl(item.tensor)->spec();
      placements[item.name] = placements_string(spec.placements());
      if (!first_mesh) first_mesh = spec.mesh();
    }
  }
  safetensors::Metadata meta;
  meta[keys::kFormat] = "pt";
  meta[keys::kCheckpointFormat] = kFormatName;
  meta[keys::kFormatVersion] = std::to_string(kCheckpointFormatVersion);
  meta[keys::kConfig] = options.config;
  meta[keys::kStep] = std::to_string(options.step);
  meta[keys::kTpDegree] = std::to_string(first_mesh ? tp_degree_of(*first_mesh) : 1);
  meta[keys::kWorldSize] = std::to_string(comm::is_initialized() ? comm::get_world_size() : 1);
  if (first_mesh) meta[keys::kMesh] = first_mesh->str();
  meta[keys::kPlacements] = placements.dump();
  meta[keys::kChecksumAlgorithm] = kChecksumAlgorithm;
  meta[keys::kChecksums] = json(checksums).dump();
  if (optimizer != nullptr) meta[keys::kOptimizer] = optimizer_description;
  meta[keys::kHeaderChecksum] = hex32(0);  // placeholder, computed when everything is known
  for (const auto& [k, v] : options.metadata) {
    TORCH_CHECK(meta.find(k) == meta.end(), "save_checkpoint: metadata key \"", k,
                "\" is reserved for the checkpoint format; choose another name");
    meta[k] = v;
  }

  // Rank 0 writes while every rank takes part in the gathers; a failure on rank 0 stops the
  // writing but not its part in the collectives, so no rank is left waiting.
  const bool writes = detail::global_rank() == 0;
  std::unique_ptr<safetensors::Writer> writer;
  std::exception_ptr error;
  if (writes) {
    try {
      writer = std::make_unique<safetensors::Writer>(path, entries, meta);
    } catch (...) {
      error = std::current_exception();
    }
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const at::Tensor& t = items[i].tensor;
    if (!is_dtensor(t) && !writes) continue;  // the others join the gathers
    at::Tensor full = is_dtensor(t) ? full_tensor(t) : t;
    if (!writes || error) continue;
    try {
      at::Tensor cpu = full.cpu().contiguous();
      checksums[items[i].name] = hex32(crc32c(cpu.const_data_ptr(), cpu.nbytes()));
      writer->write(cpu);
      if (options.on_tensor_written) options.on_tensor_written(items[i].name, i, items.size());
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (writes && !error) {
    try {
      meta[keys::kChecksums] = json(checksums).dump();
      meta[keys::kHeaderChecksum] = header_checksum(meta, writer->tensors());
      writer->finish(meta);
    } catch (...) {
      error = std::current_exception();
    }
  }
  writer.reset();  // after a failure this deletes the temporary file
  detail::share_rank0_outcome(error, "save_checkpoint('" + path + "')");
}

// ---------------------------------------------------------------------------------------------
// load

CheckpointMetadata read_checkpoint_metadata(const std::string& path) {
  safetensors::File file(path);
  return parse_metadata(file);
}

void verify_checkpoint(const std::string& path) {
  safetensors::File file(path);
  parse_metadata(file);
  const auto checksums = parse_checksums(file);
  TORCH_CHECK(!checksums.empty() || file.tensors().empty(), "checkpoint '", path,
              "' has no checksums to verify (not written by save_checkpoint)");
  for (const auto& info : file.tensors()) verify_tensor(file, info, checksums);
}

// ---------------------------------------------------------------------------------------------
// load: the steps of load_checkpoint

namespace {

// What a load will do, decided from the header alone.
struct LoadPlan {
  struct Target {
    const safetensors::TensorInfo* info;
    at::Tensor dest;
  };
  // Per optimizer parameter: no entry (starts afresh) or an entry per key in the file.
  struct ParamState {
    at::Tensor param;
    std::map<std::string, const safetensors::TensorInfo*> infos;
  };
  std::vector<Target> targets;
  std::vector<ParamState> states;
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> used;  // names in the file that something matched
};

// The file's entry for `name` when its shape is `shape`; records a miss or mismatch otherwise.
const safetensors::TensorInfo* match(const safetensors::File& file, const std::string& name,
                                     c10::IntArrayRef shape, LoadPlan& plan) {
  const safetensors::TensorInfo* info = file.find(name);
  if (info == nullptr) {
    plan.missing.push_back(name);
    return nullptr;
  }
  plan.used.insert(name);
  if (c10::IntArrayRef(info->shape) != shape) {
    plan.mismatched.push_back(name + ": checkpoint " + shape_string(info->shape) + ", module " +
                              shape_string(shape));
    return nullptr;
  }
  return info;
}

void match_module_tensors(const safetensors::File& file, torch::nn::Module& module,
                          LoadPlan& plan) {
  auto module_tensors = module.named_parameters();
  for (const auto& b : module.named_buffers()) module_tensors.insert(b.key(), b.value());
  for (const auto& t : module_tensors) {
    if (!t.value().defined()) continue;
    if (const auto* info = match(file, t.key(), t.value().sizes(), plan)) {
      plan.targets.push_back({info, t.value()});
    }
  }
}

// One parameter's optimizer state: either no entry in the file or every required key.
LoadPlan::ParamState match_param_state(const safetensors::File& file, const at::Tensor& p,
                                       const std::string& pname,
                                       const detail::StateKeys& state_keys, LoadPlan& plan) {
  LoadPlan::ParamState ps{p, {}};
  const c10::IntArrayRef shape = p.sizes();
  bool any = false;
  for (const auto* list : {&state_keys.required, &state_keys.optional}) {
    for (const auto& key : *list) any = any || file.find(optim_name(pname, key)) != nullptr;
  }
  if (!any) return ps;  // no state saved: the parameter starts afresh
  for (const auto* list : {&state_keys.required, &state_keys.optional}) {
    const bool required = list == &state_keys.required;
    for (const auto& key : *list) {
      const std::string name = optim_name(pname, key);
      const safetensors::TensorInfo* info = file.find(name);
      if (info == nullptr) {
        if (required) plan.missing.push_back(name);
        continue;
      }
      plan.used.insert(name);
      if (key == "step") {
        if (!info->shape.empty() || info->dtype != at::kLong) {
          plan.mismatched.push_back(name + ": checkpoint " + safetensors::dtype_name(info->dtype) +
                                    shape_string(info->shape) + ", expected a 0-d I64");
          continue;
        }
      } else if (c10::IntArrayRef(info->shape) != shape) {
        plan.mismatched.push_back(name + ": checkpoint " + shape_string(info->shape) +
                                  ", parameter " + shape_string(shape));
        continue;
      }
      ps.infos[key] = info;
    }
  }
  return ps;
}

void match_optimizer_state(const safetensors::File& file, const CheckpointMetadata& meta,
                           const torch::nn::Module& module,
                           const torch::optim::Optimizer& optimizer, const std::string& where,
                           LoadPlan& plan) {
  auto it = meta.entries.find(keys::kOptimizer);
  TORCH_CHECK(it != meta.entries.end(), where,
              " holds no optimizer state; load it without an optimizer");
  const auto pnames = param_names(module);
  detail::check_description(optimizer, pnames, it->second, where);
  const auto state_keys = detail::state_keys(optimizer);
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      plan.states.push_back(
          match_param_state(file, p, detail::param_name(pnames, p), state_keys, plan));
    }
  }
}

// Names in the file nothing matched (optimizer state counts only when loading an optimizer).
void collect_unexpected(const safetensors::File& file, bool with_optimizer, LoadPlan& plan) {
  for (const auto& info : file.tensors()) {
    const bool optim = info.name.rfind(kOptimPrefix, 0) == 0;
    if (plan.used.count(info.name) == 0 && (!optim || with_optimizer)) {
      plan.unexpected.push_back(info.name);
    }
  }
}

// Throws, listing every problem, when the file does not fit the module under `options`.
void check_fit(const safetensors::File& file, const std::string& where, const LoadOptions& options,
               const LoadPlan& plan) {
  const auto& missing = plan.missing;
  const auto& unexpected = plan.unexpected;
  const auto& mismatched = plan.mismatched;
  // A load that matches no name would leave everything as it was, which looks like success.
  if (plan.used.empty() && (!missing.empty() || !unexpected.empty())) {
    std::vector<std::string> in_file;
    for (const auto& info : file.tensors()) in_file.push_back(info.name);
    TORCH_CHECK(false, "load_checkpoint: ", where,
                " has no tensor name in common with the module (nothing loaded; saved from "
                "another model, or under a prefix such as a wrapper module's?)\n  the module has ",
                missing.size(), ": ", join_few(missing), "\n  the checkpoint has ", in_file.size(),
                ": ", join_few(in_file));
  }
  // Missing optimizer keys of a parameter that has state are always errors.
  const bool fatal_missing = std::any_of(missing.begin(), missing.end(), [](const std::string& n) {
    return n.rfind(kOptimPrefix, 0) == 0;
  });
  if (!mismatched.empty() || ((options.strict || fatal_missing) && !missing.empty()) ||
      (options.strict && !unexpected.empty())) {
    std::string msg = "load_checkpoint: " + where + " does not fit the module (nothing loaded):";
    if (!missing.empty()) msg += "\n  missing in the checkpoint:" + join_limited(missing);
    if (!unexpected.empty() && options.strict) {
      msg += "\n  unexpected in the checkpoint:" + join_limited(unexpected);
    }
    if (!mismatched.empty()) msg += "\n  shape mismatch:" + join_limited(mismatched);
    TORCH_CHECK(false, msg);
  }
}

// This rank's parts, read and checked, before anything is changed.
struct Staged {
  std::vector<at::Tensor> temps;  // per plan target; undefined: this rank holds no part
  std::vector<std::pair<void*, std::unique_ptr<torch::optim::OptimizerParamState>>> states;
};

Staged stage(const safetensors::File& file, const std::map<std::string, std::string>& checksums,
             bool verify, const torch::optim::Optimizer* optimizer, const LoadPlan& plan) {
  auto read_part = [&](const safetensors::TensorInfo& info, const at::Tensor& like) {
    if (verify) verify_tensor(file, info, checksums);
    return local_part(file, info, like);
  };
  Staged staged;
  staged.temps.reserve(plan.targets.size());
  for (const auto& t : plan.targets) staged.temps.push_back(read_part(*t.info, t.dest));
  for (const auto& ps : plan.states) {
    if (ps.infos.empty()) continue;
    std::map<std::string, at::Tensor> values;
    for (const auto& [key, info] : ps.infos) {
      if (key == "step") {
        if (verify) verify_tensor(file, *info, checksums);
        values[key] = file.tensor(*info);
        continue;
      }
      at::Tensor part = read_part(*info, ps.param);
      if (!part.defined()) part = local_tensor(ps.param).clone();  // rank outside the mesh
      values[key] = wrap_like(std::move(part), ps.param);
    }
    staged.states.emplace_back(ps.param.unsafeGetTensorImpl(),
                               detail::make_param_state(*optimizer, values));
  }
  return staged;
}

// Copies in place (the parameters stay the same objects), then replaces the optimizer state.
void commit(const LoadPlan& plan, Staged& staged, torch::optim::Optimizer* optimizer,
            const CheckpointMetadata& meta) {
  for (size_t i = 0; i < plan.targets.size(); ++i) {
    if (!staged.temps[i].defined()) continue;
    const at::Tensor& dest = plan.targets[i].dest;
    if (is_dtensor(dest)) {
      local_tensor(dest).copy_(staged.temps[i]);
      dest.unsafeGetTensorImpl()->bump_version();
    } else {
      dest.copy_(staged.temps[i]);
    }
  }
  if (optimizer == nullptr) return;
  for (const auto& ps : plan.states) optimizer->state().erase(ps.param.unsafeGetTensorImpl());
  for (auto& [key, state] : staged.states) optimizer->state()[key] = std::move(state);
  detail::apply_group_options(*optimizer, meta.entries.at(keys::kOptimizer));
}

}  // namespace

CheckpointMetadata load_checkpoint(const std::string& path, torch::nn::Module& module,
                                   torch::optim::Optimizer* optimizer, const LoadOptions& options) {
  at::NoGradGuard no_grad;
  const std::string where = "checkpoint '" + path + "'";
  safetensors::File file(path);
  CheckpointMetadata meta = parse_metadata(file);
  const auto checksums = parse_checksums(file);

  // 1. Match names and shapes; nothing is read yet.
  LoadPlan plan;
  match_module_tensors(file, module, plan);
  if (optimizer != nullptr) match_optimizer_state(file, meta, module, *optimizer, where, plan);
  collect_unexpected(file, optimizer != nullptr, plan);
  check_fit(file, where, options, plan);
  meta.missing_keys = std::move(plan.missing);
  meta.unexpected_keys = std::move(plan.unexpected);

  // 2. Verify and copy this rank's parts into temporaries; 3. commit them.
  const bool verify = options.verify_checksums && !checksums.empty();
  Staged staged = stage(file, checksums, verify, optimizer, plan);
  commit(plan, staged, optimizer, meta);
  return meta;
}

}  // namespace dtensor::checkpoint
