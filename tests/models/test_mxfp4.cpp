// MXFP4 dequantisation: the values of hand-made blocks, gpt-oss experts quantised as published
// checkpoints store them (tests/fixtures/hf/moe_models/gpt_oss_mxfp4) read as transformers
// dequantises them bit for bit, and scales that do not match their blocks refused naming the file,
// the tensors and both shapes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/models/hf_experts.h"
#include "dtensor/models/mxfp4.h"
#include "support/errors.h"
#include "support/temp_dir.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;
namespace safetensors = dtensor::checkpoint::safetensors;

namespace {

const std::string kDir = std::string(DTENSOR_HF_FIXTURES) + "/moe_models/gpt_oss_mxfp4/";

HfTensorSource source_of(const safetensors::File& file) {
  return {[&](const std::string& n) { return file.find(n) != nullptr; },
          [&](const std::string& n) {
            return std::pair{&file, &file.at(n)};
          }};
}

TEST(Mxfp4, NibblesAreE2M1ValuesTimesTheGroupsPowerOfTwo) {
  // One row, one group: bytes 0x21 (low nibble 1 = 0.5, high 2 = 1.0), 0xF8 (-0, -6), rest 0.
  at::Tensor blocks = at::zeros({1, 1, 16}, at::kByte);
  blocks[0][0][0] = 0x21;
  blocks[0][0][1] = 0xF8;
  const at::Tensor scales = at::full({1, 1}, 128, at::kByte);  // 2^1
  const at::Tensor v = dequantize_mxfp4(blocks, scales, at::kFloat, "test");
  ASSERT_EQ(v.sizes(), (std::vector<int64_t>{1, 32}));
  EXPECT_EQ(v[0][0].item<float>(), 1.0f);
  EXPECT_EQ(v[0][1].item<float>(), 2.0f);
  EXPECT_EQ(v[0][2].item<float>(), -0.0f);
  EXPECT_EQ(v[0][3].item<float>(), -12.0f);
  EXPECT_EQ(v.narrow(1, 4, 28).abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(dequantize_mxfp4(blocks, at::full({1, 1}, 125, at::kByte), at::kBFloat16, "test")[0][3]
                .item<float>(),
            -1.5f);  // -6 * 2^-2, exact in bfloat16
}

TEST(Mxfp4, PublishedGptOssLayoutDequantisesAsTransformersDoes) {
  safetensors::File file(kDir + "model.safetensors");
  const auto ref = safetensors::load_file(kDir + "reference.safetensors");
  const HfTensorSource source = source_of(file);
  ASSERT_TRUE(has_mxfp4_experts(source, kGptOssExperts, 0));
  const int64_t E = 4, I = 32, H = 32;
  uint64_t bytes = 0;
  auto whole = [&](ExpertParam p, std::vector<int64_t> shape) {
    return read_expert_part(source, kGptOssExperts, 0, p, shape, std::vector<int64_t>(shape.size()),
                            shape, at::kFloat, "test", &bytes);
  };
  ExpertWeights w{whole(ExpertParam::kW1, {E, I, H}), whole(ExpertParam::kW2, {E, H, I}),
                  whole(ExpertParam::kW3, {E, I, H})};
  // blocks and scales of both projections: (2I + H) rows of H / 32 groups of 17 bytes
  EXPECT_EQ(bytes, static_cast<uint64_t>(E * (2 * (2 * I) * 17 + H * 17)));
  for (const auto& [name, t] : hf_expert_tensors(kGptOssExperts, 0, w)) {
    const std::string key = "dequantized.0." + name.substr(name.rfind('.') + 1);
    EXPECT_TRUE(at::equal(t, ref.at(key))) << key;
  }
}

TEST(Mxfp4, ScalesThatDoNotMatchTheirBlocksAreRefusedNamingFileTensorsAndShapes) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const std::string p = "model.layers.0.mlp.experts.";
  safetensors::save_file({{p + "gate_up_proj_blocks", at::zeros({4, 64, 1, 16}, at::kByte)},
                          {p + "gate_up_proj_scales", at::zeros({4, 32, 1}, at::kByte)}},
                         path);
  safetensors::File file(path);
  uint64_t bytes = 0;
  EXPECT_ERROR(read_expert_part(source_of(file), kGptOssExperts, 0, ExpertParam::kW1, {4, 32, 32},
                                {0, 0, 0}, {4, 32, 32}, at::kFloat, "test", &bytes),
               c10::Error, path, "gate_up_proj_scales", "[4, 32, 1]", "gate_up_proj_blocks",
               "[4, 64, 1, 16]", "do not match");
  EXPECT_ERROR(dequantize_mxfp4(at::zeros({2, 1, 16}, at::kByte), at::zeros({2, 2}, at::kByte),
                                at::kFloat, "file 'f', tensor \"t\""),
               c10::Error, "file 'f', tensor \"t\"", "scales [2, 2]", "blocks [2, 1, 16]");
}

}  // namespace
