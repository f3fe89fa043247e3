#pragma once
// PyTorch's OpInfo samples as ATen call sequences (written by scripts/opinfo-sweep into
// tests/ops/opinfo/): loading them and replaying one through the dispatcher, on plain tensors
// or on DTensors (docs/OPINFO.md).
#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dtensor::testing::opinfo {

/// One input tensor of a sample, stored in samples.safetensors.
struct SampleInput {
  std::string name;
  bool requires_grad = false;
};

/// One OpInfo sample: the ATen calls it reaches and which of their values are its results.
struct Sample {
  std::string op;       ///< OpInfo name ("nn.functional.conv2d")
  std::string variant;  ///< OpInfo variant_test_name ("" for most)
  int index = 0;        ///< Which sample of the OpInfo (0, 1, 2)
  std::vector<SampleInput> inputs;
  std::vector<std::string> constants;  ///< tensors made inside the op (plain on every run)
  nlohmann::json calls;                ///< [{"op": "aten::add.Tensor", "args": [...]}]
  nlohmann::json results;              ///< [{"ref": [call, output(, list index)]} | {"input": n}]
  std::vector<int> grad_results;       ///< results that require grad on one device

  /// "op" or "op.variant", as PyTorch's lists name OpInfos.
  std::string key() const { return variant.empty() ? op : op + "." + variant; }
};

/// Every sample and its tensors, read from `dir`/samples.{json,safetensors}.
struct SampleSet {
  std::vector<Sample> samples;
  std::map<std::string, at::Tensor> tensors;    ///< by name, CPU, contiguous
  std::map<std::string, std::string> left_out;  ///< OpInfo key -> why it has no sample
  nlohmann::json meta;                          ///< the generating torch version and limits
};
SampleSet load_samples(const std::string& dir);

/// The values a replay produced: per call, its returns (as the boxed stack left them).
struct Replay {
  std::vector<std::vector<c10::IValue>> outputs;
  /// The sample's results, in order (tensors, tensor lists or plain values).
  std::vector<c10::IValue> results;
};

/// Runs `sample`'s calls through the dispatcher with `inputs` (by input name; DTensors or plain
/// tensors) and `constants` (by name). Throws what the first failing op throws.
Replay replay(const Sample& sample, const std::map<std::string, at::Tensor>& inputs,
              const std::map<std::string, at::Tensor>& constants);

}  // namespace dtensor::testing::opinfo
