// parallelize_module: resolve the plan to (module, style) pairs, validate them all, then apply them
// in order; on a failure, put the model back as it was.
#include "dtensor/tp/parallelize_module.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <fnmatch.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string_view>

#include "dtensor/comm/collectives.h"
#include "dtensor/comm/recording_backend.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/tp/module_hooks.h"
#include "dtensor/util/hash.h"
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

// What every rank must agree on before applying a plan, one (label, value) item per line:
// the plan's keys and styles, the model's parameters and buffers, the mesh.
struct SetupItem {
  std::string label, value;
};

std::string describe_setup(const torch::nn::Module& root, const ParallelizePlan& plan,
                           const DeviceMesh& mesh) {
  std::ostringstream os;
  auto item = [&](const std::string& label, const auto& value) {
    os << label << '\t' << value << '\n';
  };
  for (const auto& [key, style] : plan) item("plan key '" + key + "'", style.repr());
  auto tensors = [&](const char* kind, const torch::OrderedDict<std::string, at::Tensor>& dict) {
    for (const auto& t : dict) {
      const std::string label = std::string(kind) + " '" + t.key() + "'";
      item(label + " shape", t.value().sizes());
      item(label + " dtype", t.value().scalar_type());
    }
  };
  tensors("parameter", root.named_parameters());
  tensors("buffer", root.named_buffers());
  item("mesh", mesh.str());
  return os.str();
}

std::vector<SetupItem> parse_setup(const std::string& text) {
  std::vector<SetupItem> items;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) {
    const size_t tab = line.find('\t');
    items.push_back({line.substr(0, tab), tab == std::string::npos ? "" : line.substr(tab + 1)});
  }
  return items;
}

// FNV-1a: equal texts give equal hashes on every rank and build.
int64_t setup_hash(const std::string& text) { return static_cast<int64_t>(util::fnv1a(text)); }

// The first difference between rank 0's setup and rank `r`'s.
std::string first_difference(const std::string& text0, const std::string& text_r, int64_t r) {
  const auto a = parse_setup(text0), b = parse_setup(text_r);
  const std::string ranks = "rank " + std::to_string(r) + " differs from rank 0 ";
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i >= a.size())
      return ranks + "by an extra " + b[i].label + " (" + b[i].value + ") on rank " +
             std::to_string(r);
    if (i >= b.size())
      return ranks + "by a missing " + a[i].label + " (" + a[i].value + " on rank 0)";
    if (a[i].label != b[i].label)
      return ranks + "at item " + std::to_string(i) + ": rank 0 has " + a[i].label + " (" +
             a[i].value + "), rank " + std::to_string(r) + " has " + b[i].label + " (" +
             b[i].value + ")";
    if (a[i].value != b[i].value)
      return ranks + "at " + a[i].label + ": " + a[i].value + " on rank 0 vs " + b[i].value +
             " on rank " + std::to_string(r);
  }
  return ranks + "in a setup that describes the same (a hash collision)";
}

// Every rank of the mesh must parallelize the same model structure with the same plan over the
// same mesh; otherwise ranks shard differently and later collectives mismatch or hang. One
// all_gather of a hash checks it; only on a difference are the descriptions exchanged, so that
// every rank fails with the same message naming the first difference.
void check_same_on_every_rank(const torch::nn::Module& root, const ParallelizePlan& plan,
                              const DeviceMesh& mesh) {
  // A simulated world (comm/recording_backend.h) has no other ranks to compare with.
  if (mesh.size() == 1 || !mesh.contains_this_rank() || comm::is_simulated()) return;
  comm::ProcessGroup& pg = mesh.group(0);
  const auto options = at::TensorOptions().dtype(at::kLong).device(mesh.device());
  const std::string text = describe_setup(root, plan, mesh);
  const at::Tensor hashes =
      comm::all_gather_into_tensor(at::full({1}, setup_hash(text), options), 0, pg).cpu();
  int64_t differing = -1;
  for (int64_t r = 1; r < hashes.numel() && differing < 0; ++r)
    if (hashes[r].item<int64_t>() != hashes[0].item<int64_t>()) differing = r;
  if (differing < 0) return;

  // Texts of unequal length travel padded to the longest.
  const auto n = static_cast<int64_t>(text.size());
  const at::Tensor lengths = comm::all_gather_into_tensor(at::full({1}, n, options), 0, pg).cpu();
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::memcpy(mine.data_ptr(), text.data(), text.size());
  const at::Tensor all =
      comm::all_gather_into_tensor(mine.to(mesh.device()), 0, pg).cpu().view({-1, longest});
  auto text_of = [&](int64_t r) {
    const auto* bytes = static_cast<const char*>(all[r].data_ptr());
    return std::string(bytes, lengths[r].item<int64_t>());
  };
  TORCH_CHECK(false,
              "parallelize_module: ", first_difference(text_of(0), text_of(differing), differing),
              ". Every rank of ", mesh.str(),
              " must call parallelize_module with the same plan, on a model with the same "
              "parameters (names, shapes, dtypes), over the same mesh; look for code that builds "
              "the plan or the model differently per rank. Nothing was changed.");
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
  TORCH_CHECK(style.ptr() != nullptr, "parallelize_module: no style given");
  check_same_on_every_rank(module, {{"", style}}, mesh);
  std::vector<Entry> entries{{&module, "", style}};
  apply_entries(module, mesh, entries, src_data_rank);
  return module;
}

torch::nn::Module& parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                                      const ParallelizePlan& plan,
                                      std::optional<int64_t> src_data_rank) {
  check_tp_mesh(mesh);
  for (const auto& [key, style] : plan)
    TORCH_CHECK(style.ptr() != nullptr, "parallelize_module: plan key '", key, "' has no style");
  check_same_on_every_rank(module, plan, mesh);
  std::vector<Entry> entries;
  for (const auto& [key, style] : plan) {
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
