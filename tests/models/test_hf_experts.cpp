// The mixture-of-experts families' expert tensors in Hugging Face checkpoints
// (tests/fixtures/hf/moe_models): per-expert tensors (Qwen3-MoE, Mixtral) and gpt-oss's stacked,
// interleaved ones read into our stacked [E, ...] parameters and written back as the very tensors
// save_pretrained wrote; a rank's block of a parameter read with only its bytes; a missing or
// misshapen expert tensor refused naming the file, the tensor and the shapes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/models/hf_experts.h"
#include "support/errors.h"
#include "support/temp_dir.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;
namespace safetensors = dtensor::checkpoint::safetensors;

namespace {

const std::string kModels = std::string(DTENSOR_HF_FIXTURES) + "/moe_models/";

struct Case {
  std::string name;
  HfExpertLayout layout;
  int64_t E, I;
  bool biases;
};

std::vector<Case> cases() {
  return {{"qwen3_moe", kQwen3MoeExperts, 8, 16, false},
          {"mixtral", kMixtralExperts, 4, 16, false},
          {"gpt_oss", kGptOssExperts, 4, 32, true},
          {"gpt_oss_mxfp4", kGptOssExperts, 4, 32, true}};
}

HfTensorSource source_of(const safetensors::File& file) {
  return {[&](const std::string& n) { return file.find(n) != nullptr; },
          [&](const std::string& n) {
            return std::pair{&file, &file.at(n)};
          }};
}

std::vector<int64_t> shape_of(ExpertParam p, int64_t E, int64_t I, int64_t H) {
  switch (p) {
    case ExpertParam::kW1:
    case ExpertParam::kW3:
      return {E, I, H};
    case ExpertParam::kW2:
      return {E, H, I};
    case ExpertParam::kB2:
      return {E, H};
    default:
      return {E, I};
  }
}

ExpertWeights read_whole(const HfTensorSource& source, const Case& c, int64_t layer,
                         uint64_t* bytes) {
  ExpertWeights w;
  at::Tensor* slots[] = {&w.w1, &w.w2, &w.w3, &w.b1, &w.b2, &w.b3};
  for (int i = 0; i < (c.biases ? 6 : 3); ++i) {
    const auto p = static_cast<ExpertParam>(i);
    const auto shape = shape_of(p, c.E, c.I, 32);
    *slots[i] =
        read_expert_part(source, c.layout, layer, p, shape, std::vector<int64_t>(shape.size()),
                         shape, at::kFloat, "test", bytes);
  }
  return w;
}

TEST(HfExperts, SavedTensorsAreTheOnesSavePretrainedWrote) {
  for (const Case& c : cases()) {
    if (c.name == "gpt_oss_mxfp4") continue;  // saved unquantised
    safetensors::File file(kModels + c.name + "/model.safetensors");
    uint64_t bytes = 0;
    const ExpertWeights w = read_whole(source_of(file), c, 0, &bytes);
    const auto tensors = hf_expert_tensors(c.layout, 0, w);
    uint64_t stored = 0;
    for (const auto& [name, t] : tensors) {
      EXPECT_TRUE(at::equal(t, file.tensor(name))) << c.name << " " << name;
      stored += file.at(name).nbytes();
    }
    // Every expert tensor of layer 0 was read once and written once; gpt-oss's gate and up
    // columns (and biases) are read as one range for w1 and again for w3.
    if (c.name == "gpt_oss") {
      for (const char* twice : {"gate_up_proj", "gate_up_proj_bias"})
        stored += file.at("model.layers.0.mlp.experts." + std::string(twice)).nbytes();
    }
    EXPECT_EQ(bytes, stored) << c.name;
    EXPECT_EQ(tensors.size(), c.biases ? 4u : static_cast<size_t>(3 * c.E)) << c.name;
  }
}

TEST(HfExperts, ARanksBlockIsReadWithItsBytesOnly) {
  // TP 2 splitting each expert's columns: w1/w3 rows [I/2, I), w2 columns [I/2, I), b1/b3 too.
  for (const Case& c : cases()) {
    safetensors::File file(kModels + c.name + "/model.safetensors");
    const HfTensorSource source = source_of(file);
    uint64_t whole_bytes = 0;
    const ExpertWeights whole = read_whole(source, c, 0, &whole_bytes);
    const at::Tensor* full[] = {&whole.w1, &whole.w2, &whole.w3, &whole.b1, &whole.b2, &whole.b3};
    for (int i = 0; i < (c.biases ? 6 : 3); ++i) {
      const auto p = static_cast<ExpertParam>(i);
      if (p == ExpertParam::kB2) continue;  // replicated
      const auto shape = shape_of(p, c.E, c.I, 32);
      const int64_t dim = p == ExpertParam::kW2 ? 2 : 1, half = c.I / 2;
      std::vector<int64_t> offset(shape.size(), 0), size = shape;
      offset[static_cast<size_t>(dim)] = half;
      size[static_cast<size_t>(dim)] = half;
      uint64_t bytes = 0;
      const at::Tensor part =
          read_expert_part(source, c.layout, 0, p, shape, offset, size, at::kFloat, "test", &bytes);
      EXPECT_TRUE(at::equal(part, full[i]->narrow(dim, half, half)))
          << c.name << " " << expert_param_name(p);
      uint64_t expected = part.nbytes();
      if (c.name == "gpt_oss" && p != ExpertParam::kW2) expected *= 2;  // gate and up columns
      if (c.name == "gpt_oss_mxfp4" && dim == 1 && p != ExpertParam::kB1 && p != ExpertParam::kB3)
        expected = static_cast<uint64_t>(c.E * 2 * half * 17);  // both rows, 17 bytes per group
      if (c.name == "gpt_oss_mxfp4" && p == ExpertParam::kW2)
        expected = static_cast<uint64_t>(c.E * 32 * 17);  // whole groups of 32 columns
      if (c.name == "gpt_oss_mxfp4" && (p == ExpertParam::kB1 || p == ExpertParam::kB3))
        expected *= 2;
      EXPECT_EQ(bytes, expected) << c.name << " " << expert_param_name(p);
    }
  }
}

TEST(HfExperts, MissingOrMisshapenExpertTensorsAreRefusedNamingFileTensorAndShapes) {
  TempDir dir;
  safetensors::File good(kModels + "qwen3_moe/model.safetensors");
  std::map<std::string, at::Tensor> tensors;
  for (const auto& info : good.tensors()) tensors[info.name] = good.tensor(info);
  const std::string missing = "model.layers.0.mlp.experts.3.up_proj.weight";
  const std::string bent = "model.layers.0.mlp.experts.5.gate_proj.weight";
  tensors.erase(missing);
  tensors[bent] = at::zeros({16, 31});
  const std::string path = dir.file("model.safetensors");
  safetensors::save_file(tensors, path);
  safetensors::File file(path);
  HfTensorSource source = source_of(file);
  source.locate = [&](const std::string& n) {
    const auto* info = file.find(n);
    TORCH_CHECK(info != nullptr, "safetensors file '", path, "' has no tensor \"", n, "\"");
    return std::pair{&file, info};
  };
  uint64_t bytes = 0;
  const std::vector<int64_t> w13{8, 16, 32};
  EXPECT_ERROR(read_expert_part(source, kQwen3MoeExperts, 0, ExpertParam::kW3, w13, {0, 0, 0}, w13,
                                at::kFloat, "num_experts=8", &bytes),
               c10::Error, path, missing);
  EXPECT_ERROR(read_expert_part(source, kQwen3MoeExperts, 0, ExpertParam::kW1, w13, {0, 0, 0}, w13,
                                at::kFloat, "num_experts=8, moe_intermediate_size=16", &bytes),
               c10::Error, path, bent, "shape [16, 31]", "[16, 32]", "moe_intermediate_size=16");
}

}  // namespace
