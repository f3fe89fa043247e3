#include "style_support.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/core/shard_math.h"

namespace dtensor::tp::detail {

std::string py_bool(bool b) { return b ? "True" : "False"; }

std::string py_layout(const std::optional<Placement>& p) { return p ? p->repr() : "None"; }

std::string py_tuple(const Layouts& layouts) {
  std::string s;
  for (size_t i = 0; i < layouts.size(); ++i) s += (i ? ", " : "") + py_layout(layouts[i]);
  return "(" + s + (layouts.size() == 1 ? ",)" : ")");
}

std::string py_optional_tuple(const std::optional<Layouts>& layouts) {
  return layouts ? py_tuple(*layouts) : "None";
}

std::string py_dict(const std::optional<KwargLayouts>& layouts) {
  // PyTorch stores a missing kwarg dict as {} and prints it so.
  std::string s;
  if (layouts) {
    for (const auto& [name, layout] : *layouts)
      s += (s.empty() ? "" : ", ") + ("'" + name + "': " + py_layout(layout));
  }
  return "{" + s + "}";
}

std::string module_type_name(const torch::nn::Module& module) {
  std::string name = module.name();
  constexpr std::string_view kImpl = "Impl";
  if (name.size() > kImpl.size() && name.ends_with(kImpl)) name.resize(name.size() - kImpl.size());
  return name;
}

std::string describe_module(const torch::nn::Module& module, const std::string& fqn) {
  const std::string where = fqn.empty() ? "the root module" : "module '" + fqn + "'";
  return where + " (" + module_type_name(module) + ")";
}

namespace {

// The hook-capable replacement for a standard layer, or "" for other modules.
std::string drop_in_for(const torch::nn::Module& module) {
  if (dynamic_cast<const torch::nn::LinearImpl*>(&module))
    return "dtensor::nn::Linear, a drop-in subclass of torch::nn::LinearImpl";
  if (dynamic_cast<const torch::nn::EmbeddingImpl*>(&module))
    return "dtensor::nn::Embedding, a drop-in subclass of torch::nn::EmbeddingImpl";
  if (dynamic_cast<const torch::nn::LayerNormImpl*>(&module))
    return "dtensor::nn::LayerNorm, a drop-in subclass of torch::nn::LayerNormImpl";
  if (dynamic_cast<const torch::nn::DropoutImpl*>(&module))
    return "dtensor::nn::Dropout, a drop-in subclass of torch::nn::DropoutImpl";
  return "";
}

}  // namespace

void throw_needs_hooks(const torch::nn::Module& module, const std::string& fqn,
                       const std::string& style_repr, const std::string& need,
                       const std::string& dtensor_alternative) {
  const std::string type = module_type_name(module);
  const std::string drop_in = drop_in_for(module);
  std::string fix = drop_in.empty() ? "derive " : "use " + drop_in + ", or derive ";
  fix += "your module from dtensor::nn::Module and route forward through call_forward";
  if (!dtensor_alternative.empty()) fix += "; or " + dtensor_alternative;
  TORCH_CHECK(false, style_repr, " cannot be applied to ", describe_module(module, fqn), ": ", need,
              " needs a forward hook, and ", type,
              " is not hook-capable (not a dtensor::tp::HookedModule). To fix: ", fix, ".");
}

void distribute_parameters(torch::nn::Module& module, const DeviceMesh& mesh,
                           std::optional<int64_t> src_data_rank, const ParamLayout& layout) {
  distribute_module(
      module, mesh,
      [&](const std::string&, torch::nn::Module& sub, const DeviceMesh& m) {
        if (&sub != &module) return;
        for (const auto& p : sub.named_parameters(/*recurse=*/false)) {
          const std::optional<Placement> placement = layout(p.key());
          if (!p.value().defined() || !placement) continue;
          replace_parameter(sub, p.key(),
                            distribute_tensor(p.value().detach(), m, {*placement}, src_data_rank));
        }
      },
      src_data_rank);
}

ParamLayout colwise_layout(bool embedding) {
  return [embedding](const std::string&) -> std::optional<Placement> {
    return Shard(embedding ? 1 : 0);
  };
}

ParamLayout rowwise_layout(bool linear) {
  return [linear](const std::string& name) -> std::optional<Placement> {
    if (!linear) return Shard(0);
    if (name == "weight") return Shard(1);
    if (name == "bias") return Replicate();
    return std::nullopt;
  };
}

namespace {
// A Linear's input sharded on its features has in_features of them globally: giving from_local
// that shape keeps an uneven split (features not divisible by the ranks) the same global
// tensor on every rank, where the default (local size x ranks) would differ between ranks.
FromLocalOptions linear_input_shape(const at::Tensor& local, const Placement& layout,
                                    const torch::nn::Module& module) {
  const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&module);
  if (!linear || !layout.is_shard() || local.dim() == 0 ||
      layout.normalized(local.dim()).dim() != local.dim() - 1) {
    return {};
  }
  std::vector<int64_t> shape = local.sizes().vec();
  shape.back() = linear->options.in_features();
  return {.shape = shape, .stride = default_strides(shape)};
}

// The first positional input of a Colwise/Rowwise module: a plain tensor becomes a DTensor with
// `input_layout`; then, if the declared layout differs from `desired`, it is redistributed
// (async). An incoming DTensor's own placements are not checked, as in PyTorch.
void prepare_first_input(ModuleCall& call, const DeviceMesh& mesh, Placement input_layout,
                         Placement desired, const char* style, const torch::nn::Module& module) {
  TORCH_CHECK(!call.args.empty() && call.args[0].isTensor(), style, " on ",
              module_type_name(module), " expects a tensor as the first positional input, got ",
              call.args.empty() ? std::string("no positional input") : call.args[0].tagKind());
  at::Tensor input = call.args[0].toTensor();
  if (!is_dtensor(input))
    input =
        from_local(input, mesh, {input_layout}, linear_input_shape(input, input_layout, module));
  if (input_layout != desired) input = redistribute(input, {desired}, {.async_op = true});
  call.args[0] = std::move(input);
}

// The output of a Colwise/Rowwise module: redistributed (async) to `output_layout` when its
// placement differs; the local shard when `use_local_output`.
void prepare_single_output(c10::IValue& output, Placement output_layout, bool use_local_output,
                           const char* style, const torch::nn::Module& module) {
  TORCH_CHECK(output.isTensor() && is_dtensor(output.toTensor()), style, " on ",
              module_type_name(module), " expects the module to return a DTensor, got ",
              output.isTensor() ? "a plain tensor" : output.tagKind());
  at::Tensor out = output.toTensor();
  const int64_t ndim = out.dim();
  const Placements& current = placements(out);
  // PyTorch compares Shard(-1) with the normalised Shard(ndim-1) as different and then
  // redistributes to the same layout; comparing normalised placements skips that no-op.
  if (current.size() != 1 || current[0].normalized(ndim) != output_layout.normalized(ndim))
    out = redistribute(out, {output_layout}, {.async_op = true});
  output = use_local_output ? to_local(out) : out;
}

}  // namespace

c10::IValue prepare_value(const c10::IValue& value, const DeviceMesh& mesh,
                          const std::optional<Placement>& layout,
                          const std::optional<Placement>& desired, bool use_local,
                          const char* what) {
  if (!layout) return value;
  TORCH_CHECK(value.isTensor(), "expecting ", what, " to be a torch.Tensor! (got ", value.tagKind(),
              " for an ", what, " with layout ", layout->repr(), ")");
  at::Tensor t = value.toTensor();
  if (!is_dtensor(t)) t = from_local(t, mesh, {*layout});
  if (desired && *layout != *desired) t = redistribute(t, {*desired});
  return use_local ? to_local(t) : t;
}

std::string linear_style_repr(const LinearStyleSpec& s) {
  return std::string(s.name) + "(input_layouts=(" + s.input.repr() + ",), output_layouts=(" +
         s.output.repr() + ",), use_local_output=" + py_bool(s.use_local_output) + ")";
}

bool check_linear_or_embedding(const LinearStyleSpec& s, const torch::nn::Module& module,
                               const std::string& fqn) {
  const bool linear = dynamic_cast<const torch::nn::LinearImpl*>(&module) != nullptr;
  const bool embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(&module) != nullptr;
  TORCH_CHECK_NOT_IMPLEMENTED(
      linear || embedding, s.name, " currently only support nn.Linear and nn.Embedding! (",
      describe_module(module, fqn),
      " is neither a torch::nn::LinearImpl nor a torch::nn::EmbeddingImpl)");
  return linear;
}

void check_hooks_not_needed(const LinearStyleSpec& s, torch::nn::Module& module,
                            const std::string& fqn) {
  if (hooks_of(module)) return;
  std::vector<std::string> needs;
  if (s.input != s.input_desired)
    needs.push_back("taking the input as input_layouts=(" + s.input.repr() +
                    ",) and redistributing it to " + s.input_desired.repr());
  if (s.output != s.plain_output)
    needs.push_back("redistributing the output to output_layouts=(" + s.output.repr() + ",)");
  if (s.use_local_output) needs.push_back("returning the local shard (use_local_output=True)");
  if (needs.empty()) return;
  const bool only_local = needs.size() == 1 && s.use_local_output;
  throw_needs_hooks(module, fqn, linear_style_repr(s), c10::Join(" and ", needs),
                    only_local ? "set use_local_output=false and pass DTensor inputs"
                               : "keep the default layouts, set use_local_output=false and pass " +
                                     s.input_desired.repr() + " DTensor inputs");
}

void apply_linear_style(const LinearStyleSpec& s, torch::nn::Module& module, const DeviceMesh& mesh,
                        std::optional<int64_t> src_data_rank, const ParamLayout& layout) {
  distribute_parameters(module, mesh, src_data_rank, layout);
  HookedModule* hooks = hooks_of(module);
  if (!hooks) return;
  hooks->register_forward_pre_hook([s, mesh](torch::nn::Module& m, ModuleCall& call) {
    prepare_first_input(call, mesh, s.input, s.input_desired, s.name, m);
  });
  hooks->register_forward_hook([s](torch::nn::Module& m, const ModuleCall&, c10::IValue& out) {
    prepare_single_output(out, s.output, s.use_local_output, s.name, m);
  });
}

}  // namespace dtensor::tp::detail
