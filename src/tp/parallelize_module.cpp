// parallelize_module: resolve the plan to (module, style) pairs, validate them all, then apply them
// in order; on a failure, put the model back as it was.
#include "dtensor/tp/parallelize_module.h"

#include <c10/util/Exception.h>
#include <fnmatch.h>

#include <map>
#include <memory>
#include <string_view>

#include "dtensor/core/distribute_module.h"
#include "dtensor/tp/module_hooks.h"
#include "style_support.h"

namespace dtensor::tp {

bool fnmatch(std::string_view pattern, std::string_view name) {
  // libc's fnmatch without FNM_PATHNAME or escapes is Python's fnmatchcase on one path segment.
  const std::string p(pattern), n(name);
  return ::fnmatch(p.c_str(), n.c_str(), FNM_NOESCAPE) == 0;
}

namespace {

struct Entry {
  torch::nn::Module* module;
  std::string fqn;
  Style style;
};

std::string join_fqn(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

std::vector<std::string> split_path(const std::string& key) {
  std::vector<std::string> tokens;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    tokens.push_back(key.substr(start, dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return tokens;
}

// Every submodule reached by matching tokens[i..] one segment at a time against the names of
// direct children; warns for each branch that finds no match, as PyTorch does.
void resolve(torch::nn::Module& module, const std::string& fqn,
             const std::vector<std::string>& tokens, size_t i, const std::string& key,
             const Style& style, std::vector<Entry>& out) {
  bool matched = false;
  for (const auto& child : module.named_children()) {
    if (!fnmatch(tokens[i], child.key())) continue;
    matched = true;
    const std::string child_fqn = join_fqn(fqn, child.key());
    if (i + 1 == tokens.size()) {
      out.push_back({child.value().get(), child_fqn, style});
    } else {
      resolve(*child.value(), child_fqn, tokens, i + 1, key, style, out);
    }
  }
  if (!matched) {
    TORCH_WARN("Parallelize plan key '", key,
               "' could not be resolved: no submodule matching token '", tokens[i], "' in module ",
               detail::describe_module(module, fqn), ", skipping this plan entry.");
  }
}

// The state parallelize_module may change, for every module under the root: parameter and
// buffer tensors, the hooks present, and whether distribute_module was applied.
class ModelSnapshot {
 public:
  explicit ModelSnapshot(torch::nn::Module& root) {
    take(root);
    for (const auto& item : root.named_modules("", /*include_self=*/false)) take(*item.value());
  }

  // Puts back every parameter and buffer that was swapped, removes every hook added, and
  // forgets new distribute_module marks.
  void restore() {
    for (Saved& s : saved_) {
      for (const auto& [name, tensor, requires_grad] : s.params) {
        const auto current = s.module->named_parameters(/*recurse=*/false);
        const at::Tensor* now = current.find(name);
        if (now && now->unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl()) continue;
        replace_parameter(*s.module, name, tensor);
        if (tensor.requires_grad() != requires_grad) tensor.set_requires_grad(requires_grad);
      }
      for (const auto& [name, tensor] : s.buffers) {
        const auto current = s.module->named_buffers(/*recurse=*/false);
        const at::Tensor* now = current.find(name);
        if (now && now->unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl()) continue;
        replace_buffer(*s.module, name, tensor);
      }
      if (s.hooks) {
        const size_t now = s.hooks->next_hook_handle();
        for (size_t h = s.hook_mark; h < now; ++h) s.hooks->remove_hook(h);
      }
      if (!s.distributed && is_distributed_module(*s.module)) forget_distributed_module(*s.module);
    }
  }

 private:
  struct Param {
    std::string name;
    at::Tensor tensor;
    bool requires_grad;
  };
  struct Saved {
    torch::nn::Module* module;
    std::vector<Param> params;
    std::vector<std::pair<std::string, at::Tensor>> buffers;
    HookedModule* hooks;
    size_t hook_mark;  // hooks with a handle from here on were added after the snapshot
    bool distributed;
  };

  void take(torch::nn::Module& m) {
    Saved s{&m, {}, {}, detail::hooks_of(m), 0, is_distributed_module(m)};
    for (const auto& p : m.named_parameters(/*recurse=*/false))
      s.params.push_back({p.key(), p.value(), p.value().requires_grad()});
    for (const auto& b : m.named_buffers(/*recurse=*/false))
      s.buffers.emplace_back(b.key(), b.value());
    if (s.hooks) s.hook_mark = s.hooks->next_hook_handle();
    saved_.push_back(std::move(s));
  }

  std::vector<Saved> saved_;
};

void check_tp_mesh(const DeviceMesh& mesh) {
  TORCH_CHECK_VALUE(mesh.ndim() == 1, "Tensor Parallel only accepts a 1D DeviceMesh, but found ",
                    mesh.ndim(),
                    "D!If you have a 2-D or N-D device_mesh, consider passing in "
                    "device_mesh[\"tp\"] (got ",
                    mesh.str(), ")");
}

DeviceMesh mesh_from_context() {
  std::optional<DeviceMesh> mesh = current_mesh();
  TORCH_CHECK(mesh.has_value(),
              "parallelize_module: no device_mesh given and no current mesh; pass the mesh or "
              "call it inside a MeshGuard");
  return *mesh;
}

void apply_entries(torch::nn::Module& root, const DeviceMesh& mesh, std::vector<Entry>& entries,
                   std::optional<int64_t> src_data_rank) {
  name_modules(root);  // so hooked modules attribute their collectives to their FQN
  for (Entry& e : entries) e.style->src_data_rank = src_data_rank;
  // Everything is checked before anything changes.
  std::map<const torch::nn::Module*, const Entry*> distributed_by;
  for (const Entry& e : entries) {
    e.style->validate(*e.module, e.fqn, mesh);
    if (!e.style->uses_distribute_module()) continue;
    TORCH_CHECK(!is_distributed_module(*e.module),
                "parallelize_module: ", detail::describe_module(*e.module, e.fqn),
                " has already been parallelized (its parameters are DTensors); ", e.style.repr(),
                " cannot shard them again");
    auto [it, first] = distributed_by.emplace(e.module, &e);
    TORCH_CHECK(first, "parallelize_module: the plan gives ",
                detail::describe_module(*e.module, e.fqn), " two parameter-sharding styles, ",
                it->second->style.repr(), " and ", e.style.repr(),
                "; a module's parameters can be sharded by one style only");
  }
  ModelSnapshot snapshot(root);
  try {
    for (const Entry& e : entries) e.style->apply(*e.module, e.fqn, mesh);
  } catch (...) {
    snapshot.restore();
    throw;
  }
}

}  // namespace

torch::nn::Module& parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                                      const Style& style, std::optional<int64_t> src_data_rank) {
  check_tp_mesh(mesh);
  std::vector<Entry> entries{{&module, "", style}};
  apply_entries(module, mesh, entries, src_data_rank);
  return module;
}

torch::nn::Module& parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                                      const ParallelizePlan& plan,
                                      std::optional<int64_t> src_data_rank) {
  check_tp_mesh(mesh);
  std::vector<Entry> entries;
  for (const auto& [key, style] : plan) {
    TORCH_CHECK(style.ptr() != nullptr, "parallelize_module: plan key '", key, "' has no style");
    if (key.empty()) {
      entries.push_back({&module, "", style});
    } else {
      resolve(module, "", split_path(key), 0, key, style, entries);
    }
  }
  apply_entries(module, mesh, entries, src_data_rank);
  return module;
}

torch::nn::Module& parallelize_module(torch::nn::Module& module, const Style& style,
                                      std::optional<int64_t> src_data_rank) {
  return parallelize_module(module, mesh_from_context(), style, src_data_rank);
}

torch::nn::Module& parallelize_module(torch::nn::Module& module, const ParallelizePlan& plan,
                                      std::optional<int64_t> src_data_rank) {
  return parallelize_module(module, mesh_from_context(), plan, src_data_rank);
}

torch::nn::Module& parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh) {
  check_tp_mesh(mesh);
  TORCH_WARN(
      "No parallelize_plan is provided and auto-parallel is not supported at the moment, "
      "so this parallelize_module call will do nothing.");
  return module;
}

torch::nn::Module& parallelize_module(torch::nn::Module& module) {
  return parallelize_module(module, mesh_from_context());
}

}  // namespace dtensor::tp
