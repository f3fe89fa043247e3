#include "op_registry.h"

#include <ATen/core/jit_type.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace dtensor::dispatch {
namespace {

std::mutex& mu() {
  static std::mutex m;
  return m;
}
struct RuleEntry {
  Rule rule;
  std::vector<int> static_args;
};
std::unordered_map<std::string, std::unique_ptr<RuleEntry>>& rules() {
  static std::unordered_map<std::string, std::unique_ptr<RuleEntry>> r;
  return r;
}
// Rules that replace an op's rule while some decision-context bits are set, in registration
// order (stable addresses: OpInfos point into them).
std::unordered_map<std::string, std::vector<std::unique_ptr<ContextRule>>>& context_rules() {
  static std::unordered_map<std::string, std::vector<std::unique_ptr<ContextRule>>> r;
  return r;
}
// Stable addresses: OpInfos point into them.
std::unordered_map<std::string, std::unique_ptr<Decomposition>>& decompositions() {
  static std::unordered_map<std::string, std::unique_ptr<Decomposition>> d;
  return d;
}

void attach_context_rules(OpInfo& info) {
  info.context_rules.clear();
  auto it = context_rules().find(info.name);
  if (it == context_rules().end()) return;
  for (const auto& c : it->second) info.context_rules.push_back(c.get());
}

void mark_static(OpInfo& info, const std::vector<int>& args) {
  for (int a : args) {
    if (a >= 0 && static_cast<size_t>(a) < info.static_arg.size()) info.static_arg[a] = true;
  }
}
std::unordered_map<const void*, std::unique_ptr<OpInfo>>& infos() {
  static std::unordered_map<const void*, std::unique_ptr<OpInfo>> m;
  return m;
}

bool is_value_like(const c10::TypePtr& t) {
  auto k = t->kind();
  if (k == c10::TypeKind::OptionalType) {
    k = t->expectRef<c10::OptionalType>().getElementType()->kind();
  }
  return k == c10::TypeKind::NumberType || k == c10::TypeKind::FloatType ||
         k == c10::TypeKind::ComplexType;
}

std::unique_ptr<OpInfo> build(const c10::OperatorHandle& op) {
  auto info = std::make_unique<OpInfo>();
  const auto& schema = op.schema();
  info->name = qualified_name(op);
  info->num_args = schema.arguments().size();
  info->num_returns = schema.returns().size();
  for (const auto& a : schema.arguments()) info->static_arg.push_back(!is_value_like(a.type()));
  for (const auto& r : schema.returns()) {
    const auto& t = r.type();
    if (t->kind() == c10::TypeKind::TensorType) {
      info->return_kind.push_back(ReturnKind::Tensor);
    } else if (t->kind() == c10::TypeKind::ListType &&
               t->expectRef<c10::ListType>().getElementType()->kind() ==
                   c10::TypeKind::TensorType) {
      info->return_kind.push_back(ReturnKind::TensorList);
    } else {
      info->return_kind.push_back(ReturnKind::Other);
    }
    int writes = -1;
    bool view = false;
    if (const auto* ai = r.alias_info()) {
      if (ai->isWrite()) {
        for (size_t i = 0; i < schema.arguments().size(); ++i) {
          const auto* aa = schema.arguments()[i].alias_info();
          if (aa && aa->isWrite() && aa->beforeSets() == ai->beforeSets())
            writes = static_cast<int>(i);
        }
      } else {
        view = true;
      }
    }
    info->return_writes_arg.push_back(writes);
    info->return_is_view.push_back(view);
  }
  {
    std::lock_guard<std::mutex> l(mu());
    auto it = rules().find(info->name);
    if (it != rules().end()) {
      info->rule = &it->second->rule;
      mark_static(*info, it->second->static_args);
    }
    attach_context_rules(*info);
    auto d = decompositions().find(info->name);
    if (d != decompositions().end()) info->decomposition = d->second.get();
  }
  return info;
}

}  // namespace

std::string qualified_name(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

void register_rule(const std::string& qualified_name, Rule rule, std::vector<int> static_args) {
  std::lock_guard<std::mutex> l(mu());
  auto& slot = rules()[qualified_name];
  if (slot) {
    *slot = RuleEntry{std::move(rule), std::move(static_args)};  // OpInfos point into it
  } else {
    slot = std::make_unique<RuleEntry>(RuleEntry{std::move(rule), std::move(static_args)});
  }
  for (auto& [k, info] : infos()) {
    if (info->name != qualified_name) continue;
    info->rule = &slot->rule;
    mark_static(*info, slot->static_args);
  }
}

void register_decomposition(const std::string& qualified_name, Decomposition decomposition) {
  std::lock_guard<std::mutex> l(mu());
  auto& slot = decompositions()[qualified_name];
  if (slot) {
    *slot = std::move(decomposition);
  } else {
    slot = std::make_unique<Decomposition>(std::move(decomposition));
  }
  for (auto& [k, info] : infos()) {
    if (info->name == qualified_name) info->decomposition = slot.get();
  }
}

void register_context_rule(const std::string& qualified_name, int64_t context_mask, Rule rule) {
  TORCH_CHECK(context_mask != 0, "register_context_rule(", qualified_name,
              "): the context mask must name at least one decision-context bit");
  std::lock_guard<std::mutex> l(mu());
  context_rules()[qualified_name].push_back(
      std::make_unique<ContextRule>(ContextRule{context_mask, std::move(rule)}));
  for (auto& [k, info] : infos()) {
    if (info->name == qualified_name) attach_context_rules(*info);
  }
}

void register_context_rule(std::initializer_list<const char*> names, int64_t context_mask,
                           const Rule& rule) {
  for (const char* n : names) register_context_rule(n, context_mask, rule);
}

void register_rule(std::initializer_list<const char*> names, const Rule& rule,
                   std::vector<int> static_args) {
  for (const char* n : names) register_rule(n, rule, static_args);
}

bool has_rule(const std::string& qualified_name) {
  std::lock_guard<std::mutex> l(mu());
  return rules().count(qualified_name) != 0;
}

std::vector<std::string> registered_rule_names() {
  std::lock_guard<std::mutex> l(mu());
  std::vector<std::string> out;
  out.reserve(rules().size());
  for (const auto& [name, entry] : rules()) out.push_back(name);
  for (const auto& [name, entries] : context_rules()) {
    if (!rules().count(name)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

const OpInfo& op_info(const c10::OperatorHandle& op) {
  const void* key = &op.schema();
  thread_local std::unordered_map<const void*, const OpInfo*> fast;
  if (auto it = fast.find(key); it != fast.end()) return *it->second;
  std::unique_ptr<OpInfo> fresh;
  {
    std::lock_guard<std::mutex> l(mu());
    auto it = infos().find(key);
    if (it != infos().end()) {
      fast.emplace(key, it->second.get());
      return *it->second;
    }
  }
  fresh = build(op);  // outside the lock: build() takes it to find the rule
  std::lock_guard<std::mutex> l(mu());
  auto [it, inserted] = infos().emplace(key, std::move(fresh));
  fast.emplace(key, it->second.get());
  return *it->second;
}

}  // namespace dtensor::dispatch
