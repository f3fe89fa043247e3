// PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput: layout conversions at a
// module's boundary, nothing else.
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include "dtensor/core/api.h"
#include "dtensor/tp/styles.h"
#include "style_support.h"

namespace dtensor::tp {
namespace {

std::optional<Placement> lookup(const KwargLayouts& layouts, const std::string& name) {
  auto it = layouts.find(name);
  return it == layouts.end() ? std::nullopt : it->second;
}

}  // namespace

// ---- PrepareModuleInput ----

PrepareModuleInput::PrepareModuleInput(PrepareModuleInputOptions options)
    : options_(std::move(options)) {
  if (options_.input_layouts) {
    TORCH_CHECK(options_.desired_input_layouts.has_value(),
                "desired module inputs should not be None!");
    TORCH_CHECK(options_.input_layouts->size() == options_.desired_input_layouts->size(),
                "input_layouts and desired_input_layouts should have same length! (got ",
                options_.input_layouts->size(), " and ", options_.desired_input_layouts->size(),
                ")");
  }
  if (options_.input_kwarg_layouts) {
    const size_t desired =
        options_.desired_input_kwarg_layouts ? options_.desired_input_kwarg_layouts->size() : 0;
    TORCH_CHECK(options_.input_kwarg_layouts->size() == desired,
                "input_kwarg_layouts and desired_input_kwarg_layouts should have same length! "
                "(got ",
                options_.input_kwarg_layouts->size(), " and ", desired, ")");
  }
}

std::string PrepareModuleInput::repr() const {
  return "PrepareModuleInput(input_layouts=" + detail::py_optional_tuple(options_.input_layouts) +
         ", desired_input_layouts=" + detail::py_optional_tuple(options_.desired_input_layouts) +
         ", input_kwarg_layouts=" + detail::py_dict(options_.input_kwarg_layouts) +
         ", desired_input_kwarg_layouts=" + detail::py_dict(options_.desired_input_kwarg_layouts) +
         ", use_local_output=" + detail::py_bool(options_.use_local_output) + ")";
}

void PrepareModuleInput::validate(torch::nn::Module& module, const std::string& fqn,
                                  const DeviceMesh& mesh) const {
  if (detail::hooks_of(module)) return;
  detail::throw_needs_hooks(module, fqn, repr(), "converting the module's inputs", "");
}

void PrepareModuleInput::apply(torch::nn::Module& module, const std::string& fqn,
                               const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  detail::hooks_of(module)->register_forward_pre_hook([mesh, o = options_](torch::nn::Module&,
                                                                           ModuleCall& call) {
    if (o.input_layouts) {
      const Layouts& layouts = *o.input_layouts;
      const Layouts& desired = *o.desired_input_layouts;
      TORCH_CHECK_VALUE(call.args.size() == layouts.size(),
                        "module inputs and input_layouts should have same length! (got ",
                        call.args.size(), " inputs and ", layouts.size(), " layouts)");
      for (size_t i = 0; i < layouts.size(); ++i)
        call.args[i] =
            detail::prepare_value(call.args[i], mesh, layouts[i], desired[i], o.use_local_output);
    }
    // Keyword inputs are converted only when kwarg layouts were given (PyTorch's with_kwargs).
    if (o.input_kwarg_layouts) {
      static const KwargLayouts kNone;
      const KwargLayouts& desired =
          o.desired_input_kwarg_layouts ? *o.desired_input_kwarg_layouts : kNone;
      for (auto& [name, value] : call.kwargs)
        value = detail::prepare_value(value, mesh, lookup(*o.input_kwarg_layouts, name),
                                      lookup(desired, name), o.use_local_output);
    }
  });
}

// ---- PrepareModuleOutput ----

PrepareModuleOutput::PrepareModuleOutput(PrepareModuleOutputOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(options_.output_layouts.size() == options_.desired_output_layouts.size(),
              "output_layouts and desired_output_layouts should have same length! (got ",
              options_.output_layouts.size(), " and ", options_.desired_output_layouts.size(), ")");
}

std::string PrepareModuleOutput::repr() const {
  return "PrepareModuleOutput(output_layouts=" + detail::py_tuple(options_.output_layouts) +
         ", desired_output_layouts=" + detail::py_tuple(options_.desired_output_layouts) +
         ", use_local_output=" + detail::py_bool(options_.use_local_output) + ")";
}

void PrepareModuleOutput::validate(torch::nn::Module& module, const std::string& fqn,
                                   const DeviceMesh& mesh) const {
  if (detail::hooks_of(module)) return;
  detail::throw_needs_hooks(module, fqn, repr(), "converting the module's outputs", "");
}

void PrepareModuleOutput::apply(torch::nn::Module& module, const std::string& fqn,
                                const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  detail::hooks_of(module)->register_forward_hook(
      [mesh, o = options_](torch::nn::Module&, const ModuleCall&, c10::IValue& output) {
        // A module returning several values returns a tuple; a single value is a 1-tuple here.
        std::vector<c10::IValue> outputs;
        if (output.isTuple()) {
          const auto& elements = output.toTupleRef().elements();
          outputs.assign(elements.begin(), elements.end());
        } else {
          outputs.push_back(output);
        }
        TORCH_CHECK_VALUE(outputs.size() == o.output_layouts.size(),
                          "module outputs and output_layouts should have same length! (got ",
                          outputs.size(), " outputs and ", o.output_layouts.size(), " layouts)");
        for (size_t i = 0; i < outputs.size(); ++i)
          outputs[i] =
              detail::prepare_value(outputs[i], mesh, o.output_layouts[i],
                                    o.desired_output_layouts[i], o.use_local_output, "output");
        output = outputs.size() == 1 ? outputs[0] : c10::ivalue::Tuple::create(std::move(outputs));
      });
}

// ---- PrepareModuleInputOutput ----

PrepareModuleInputOutput::PrepareModuleInputOutput(PrepareModuleInputOutputOptions options)
    : input_(PrepareModuleInputOptions{
          .input_layouts = std::move(options.input_layouts),
          .desired_input_layouts = std::move(options.desired_input_layouts),
          .input_kwarg_layouts = std::move(options.input_kwarg_layouts),
          .desired_input_kwarg_layouts = std::move(options.desired_input_kwarg_layouts),
          .use_local_output = options.use_local_input}),
      output_(PrepareModuleOutputOptions{
          .output_layouts = std::move(options.output_layouts),
          .desired_output_layouts = std::move(options.desired_output_layouts),
          .use_local_output = options.use_local_output}) {}

std::string PrepareModuleInputOutput::repr() const {
  const auto& i = input_.options();
  const auto& o = output_.options();
  return "PrepareModuleInputOutput(input_layouts=" + detail::py_optional_tuple(i.input_layouts) +
         ", desired_input_layouts=" + detail::py_optional_tuple(i.desired_input_layouts) +
         ", input_kwarg_layouts=" + detail::py_dict(i.input_kwarg_layouts) +
         ", desired_input_kwarg_layouts=" + detail::py_dict(i.desired_input_kwarg_layouts) +
         ", use_local_input=" + detail::py_bool(i.use_local_output) +
         ", output_layouts=" + detail::py_tuple(o.output_layouts) +
         ", desired_output_layouts=" + detail::py_tuple(o.desired_output_layouts) +
         ", use_local_output=" + detail::py_bool(o.use_local_output) + ")";
}

void PrepareModuleInputOutput::validate(torch::nn::Module& module, const std::string& fqn,
                                        const DeviceMesh& mesh) const {
  if (detail::hooks_of(module)) return;
  detail::throw_needs_hooks(module, fqn, repr(), "converting the module's inputs and outputs", "");
}

void PrepareModuleInputOutput::apply(torch::nn::Module& module, const std::string& fqn,
                                     const DeviceMesh& mesh) const {
  validate(module, fqn, mesh);
  input_.apply(module, fqn, mesh);
  output_.apply(module, fqn, mesh);
}

}  // namespace dtensor::tp
