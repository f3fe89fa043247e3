#include "support/opinfo_replay.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <fstream>
#include <limits>

#include "dtensor/checkpoint/safetensors.h"

namespace dtensor::testing::opinfo {
namespace {

using nlohmann::json;

// The names Python's str(torch.dtype) gives, without "torch.".
at::ScalarType dtype_named(const std::string& name) {
  static const std::map<std::string, at::ScalarType> names = {{"float32", at::kFloat},
                                                              {"float64", at::kDouble},
                                                              {"float16", at::kHalf},
                                                              {"bfloat16", at::kBFloat16},
                                                              {"int64", at::kLong},
                                                              {"int32", at::kInt},
                                                              {"int16", at::kShort},
                                                              {"int8", at::kChar},
                                                              {"uint8", at::kByte},
                                                              {"bool", at::kBool},
                                                              {"complex64", at::kComplexFloat},
                                                              {"complex128", at::kComplexDouble},
                                                              {"complex32", at::kComplexHalf}};
  auto it = names.find(name);
  TORCH_CHECK(it != names.end(), "opinfo samples: unknown dtype ", name);
  return it->second;
}

int64_t memory_format_named(const std::string& name) {
  if (name == "contiguous_format") return static_cast<int64_t>(at::MemoryFormat::Contiguous);
  if (name == "preserve_format") return static_cast<int64_t>(at::MemoryFormat::Preserve);
  if (name == "channels_last") return static_cast<int64_t>(at::MemoryFormat::ChannelsLast);
  if (name == "channels_last_3d") return static_cast<int64_t>(at::MemoryFormat::ChannelsLast3d);
  TORCH_CHECK(false, "opinfo samples: unknown memory format ", name);
}

double float_of(const json& v) {
  if (v.is_object()) {
    const std::string f = v.at("f");
    if (f == "nan") return std::numeric_limits<double>::quiet_NaN();
    return f == "inf" ? std::numeric_limits<double>::infinity()
                      : -std::numeric_limits<double>::infinity();
  }
  return v.get<double>();
}

// The tensors a call's arguments can name.
struct Env {
  const std::map<std::string, at::Tensor>& inputs;
  const std::map<std::string, at::Tensor>& constants;
  const std::vector<std::vector<c10::IValue>>& outputs;

  c10::IValue value(const json& v) const {
    if (v.contains("input")) return inputs.at(v.at("input").get<std::string>());
    if (v.contains("const")) return constants.at(v.at("const").get<std::string>());
    const auto& r = v.at("ref");
    const c10::IValue& out = outputs.at(r.at(0).get<size_t>()).at(r.at(1).get<size_t>());
    if (r.size() == 3) return out.toTensorList().get(r.at(2).get<size_t>());
    return out;
  }
  at::Tensor tensor(const json& v) const { return value(v).toTensor(); }
};

bool is_tensor_ref(const json& v) {
  return v.is_object() && (v.contains("input") || v.contains("const") || v.contains("ref"));
}

// Argument `v` as the schema's type `type` wants it on the boxed stack.
c10::IValue to_ivalue(const json& v, const c10::TypePtr& type, const Env& env) {
  if (v.is_null()) return c10::IValue();
  if (v.is_object()) {
    if (is_tensor_ref(v)) return env.value(v);
    if (v.contains("dtype")) return static_cast<int64_t>(dtype_named(v.at("dtype")));
    if (v.contains("layout")) {
      TORCH_CHECK(v.at("layout") == "strided", "opinfo samples: layout ", v.at("layout"));
      return static_cast<int64_t>(at::kStrided);
    }
    if (v.contains("memory_format")) return memory_format_named(v.at("memory_format"));
    if (v.contains("device")) return c10::Device(v.at("device").get<std::string>());
  }
  c10::TypePtr t = type;
  if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
  if (t->kind() == c10::TypeKind::TensorType && (v.is_number() || v.is_boolean())) {
    // A Python number passed for a Tensor argument: a wrapped-number 0-d tensor, as Python's
    // argument parser makes it.
    at::Tensor s = v.is_boolean()          ? at::scalar_tensor(v.get<bool>(), at::kBool)
                   : v.is_number_integer() ? at::scalar_tensor(v.get<int64_t>(), at::kLong)
                                           : at::scalar_tensor(v.get<double>(), at::kDouble);
    s.unsafeGetTensorImpl()->set_wrapped_number(true);
    return s;
  }
  switch (t->kind()) {
    case c10::TypeKind::ListType: {
      const c10::TypePtr elem = t->expectRef<c10::ListType>().getElementType();
      json items = v;
      if (!v.is_array()) items = json::array({v});  // int[2] given as one int
      if (elem->kind() == c10::TypeKind::TensorType) {
        c10::List<at::Tensor> out;
        for (const auto& x : items) out.push_back(env.tensor(x));
        return out;
      }
      if (elem->kind() == c10::TypeKind::OptionalType) {
        c10::List<std::optional<at::Tensor>> out;
        for (const auto& x : items) {
          out.push_back(x.is_null() ? std::optional<at::Tensor>() : env.tensor(x));
        }
        return out;
      }
      if (elem->kind() == c10::TypeKind::FloatType) {
        std::vector<double> out;
        for (const auto& x : items) out.push_back(float_of(x));
        return out;
      }
      if (elem->kind() == c10::TypeKind::BoolType) {
        c10::List<bool> out;
        for (const auto& x : items) out.push_back(x.get<bool>());
        return out;
      }
      std::vector<int64_t> out;
      for (const auto& x : items) out.push_back(x.get<int64_t>());
      return out;
    }
    case c10::TypeKind::FloatType:
      return float_of(v);
    case c10::TypeKind::BoolType:
      return v.get<bool>();
    case c10::TypeKind::StringType:
      return v.get<std::string>();
    case c10::TypeKind::NumberType:  // Scalar: Python's bool, int or float
      if (v.is_boolean()) return c10::Scalar(v.get<bool>());
      if (v.is_number_integer()) return c10::Scalar(v.get<int64_t>());
      return c10::Scalar(float_of(v));
    default:
      if (v.is_boolean()) return v.get<bool>();
      if (v.is_number_integer()) return v.get<int64_t>();
      if (v.is_number_float() || v.is_object()) return float_of(v);
      if (v.is_string()) return v.get<std::string>();
      TORCH_CHECK(false, "opinfo samples: cannot convert ", v.dump(), " to ", t->str());
  }
}

c10::OperatorHandle find_op(const std::string& qualified) {
  const auto dot = qualified.find('.');
  const std::string name = qualified.substr(0, dot);
  const std::string overload = dot == std::string::npos ? "" : qualified.substr(dot + 1);
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
}

}  // namespace

SampleSet load_samples(const std::string& dir) {
  SampleSet set;
  std::ifstream f(dir + "/samples.json");
  TORCH_CHECK(f, "opinfo samples: cannot open ", dir, "/samples.json");
  const json doc = json::parse(f);
  set.meta = doc.at("meta");
  for (const auto& [key, why] : doc.at("skipped").items()) set.left_out[key] = why;
  for (const auto& s : doc.at("samples")) {
    Sample sample;
    sample.op = s.at("op");
    sample.variant = s.at("variant");
    sample.index = s.at("sample");
    for (const auto& in : s.at("inputs")) {
      sample.inputs.push_back({in.at("name"), in.at("requires_grad")});
    }
    for (const auto& c : s.at("constants")) sample.constants.push_back(c);
    sample.calls = s.at("calls");
    sample.results = s.at("results");
    for (const auto& g : s.at("grad_results")) sample.grad_results.push_back(g);
    set.samples.push_back(std::move(sample));
  }
  set.tensors = checkpoint::safetensors::load_file(dir + "/samples.safetensors");
  return set;
}

Replay replay(const Sample& sample, const std::map<std::string, at::Tensor>& inputs,
              const std::map<std::string, at::Tensor>& constants) {
  Replay r;
  const Env env{inputs, constants, r.outputs};
  for (const auto& call : sample.calls) {
    const std::string name = call.at("op");
    const c10::OperatorHandle op = find_op(name);
    const auto& schema = op.schema();
    const auto& args = call.at("args");
    torch::jit::Stack stack;
    for (size_t i = 0; i < schema.arguments().size(); ++i) {
      const auto& a = schema.arguments()[i];
      if (i >= args.size() || (args[i].is_object() && args[i].contains("default"))) {
        TORCH_CHECK(a.default_value().has_value(), name, ": argument ", a.name(),
                    " has no default and was not recorded");
        stack.push_back(*a.default_value());
      } else {
        stack.push_back(to_ivalue(args[i], a.type(), env));
      }
    }
    op.callBoxed(stack);
    r.outputs.push_back(std::move(stack));
  }
  for (const auto& res : sample.results) r.results.push_back(env.value(res));
  return r;
}

}  // namespace dtensor::testing::opinfo
