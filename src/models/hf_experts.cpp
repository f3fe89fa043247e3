// The mixture-of-experts families' expert tensors in Hugging Face checkpoints (hf_experts.h).
#include "dtensor/models/hf_experts.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtensor/models/mxfp4.h"

namespace dtensor::models {

namespace safetensors = checkpoint::safetensors;

ExpertParam expert_param(const std::string& name) {
  if (name == "w1") return ExpertParam::kW1;
  if (name == "w2") return ExpertParam::kW2;
  if (name == "w3") return ExpertParam::kW3;
  if (name == "b1") return ExpertParam::kB1;
  if (name == "b2") return ExpertParam::kB2;
  if (name == "b3") return ExpertParam::kB3;
  TORCH_CHECK(false, "\"", name, "\" is not an expert parameter (w1, w2, w3, b1, b2, b3)");
}

const char* expert_param_name(ExpertParam p) {
  static const char* names[] = {"w1", "w2", "w3", "b1", "b2", "b3"};
  return names[static_cast<int>(p)];
}

std::string hf_expert_prefix(const HfExpertLayout& layout, int64_t layer) {
  return "model.layers." + std::to_string(layer) + "." + layout.block + ".";
}

bool has_mxfp4_experts(const HfTensorSource& source, const HfExpertLayout& layout, int64_t layer) {
  const std::string p = hf_expert_prefix(layout, layer) + "experts.";
  return layout.gate == nullptr && !source.has(p + "gate_up_proj") &&
         source.has(p + "gate_up_proj_blocks");
}

namespace {

using ExpertTensorInfo = const safetensors::TensorInfo*;
using ExpertFile = const safetensors::File*;

std::string tensor_description(ExpertFile file, const std::string& name) {
  return "safetensors file '" + file->path() + "', tensor \"" + name + "\"";
}

// The tensor `name`, checked to be floating (or uint8 when `bytes`) of shape `want`.
std::pair<ExpertFile, ExpertTensorInfo> checked_expert_tensor(const HfTensorSource& source,
                                                              const std::string& name,
                                                              c10::IntArrayRef want,
                                                              const std::string& sizes_note,
                                                              bool bytes = false) {
  const auto [file, info] = source.locate(name);
  TORCH_CHECK(bytes ? info->dtype == at::kByte : at::isFloatingType(info->dtype),
              tensor_description(file, name), ": dtype ", info->dtype, " is not ",
              bytes ? "uint8 (MXFP4)" : "a floating type");
  TORCH_CHECK(c10::IntArrayRef(info->shape) == want, tensor_description(file, name), ": shape ",
              c10::IntArrayRef(info->shape), " disagrees with config.json, which gives ", want,
              " (", sizes_note, ")");
  return {file, info};
}

at::Tensor read_block(ExpertFile file, ExpertTensorInfo info, std::vector<int64_t> offset,
                      std::vector<int64_t> size, uint64_t* bytes_read) {
  at::Tensor part = file->slice(*info, offset, size);
  *bytes_read += part.nbytes();
  return part;
}

// MXFP4 rows [row0, row0 + rows) of `name`_blocks / _scales ([E, R, C / 32, 16] / [E, R, C / 32])
// for experts [e0, e0 + ne), dequantised and cut to columns [c0, c0 + nc).
at::Tensor read_mxfp4(const HfTensorSource& source, const std::string& name, int64_t E, int64_t R,
                      int64_t C, int64_t e0, int64_t ne, int64_t row0, int64_t rows, int64_t c0,
                      int64_t nc, c10::ScalarType dtype, const std::string& sizes_note,
                      uint64_t* bytes_read) {
  const std::string bname = name + "_blocks", sname = name + "_scales";
  const auto [bfile, binfo] = source.locate(bname);
  const auto [sfile, sinfo] = source.locate(sname);
  const c10::IntArrayRef bshape(binfo->shape), sshape(sinfo->shape);
  TORCH_CHECK(
      bshape.size() >= 2 && bshape.back() == 16 && bshape.slice(0, bshape.size() - 1) == sshape,
      tensor_description(sfile, sname), ": MXFP4 scales ", sshape, " do not match blocks \"", bname,
      "\" ", bshape, " in '", bfile->path(),
      "' (blocks [..., rows, groups, 16] bytes, scales [..., rows, groups])");
  TORCH_CHECK(C % 32 == 0, tensor_description(bfile, bname),
              ": MXFP4 groups 32 values, but rows of ", C, " do not split into them (", sizes_note,
              ")");
  checked_expert_tensor(source, bname, {E, R, C / 32, 16}, sizes_note, /*bytes=*/true);
  checked_expert_tensor(source, sname, {E, R, C / 32}, sizes_note, /*bytes=*/true);
  const int64_t g0 = c0 / 32, ng = (c0 + nc + 31) / 32 - g0;
  const at::Tensor blocks =
      read_block(bfile, binfo, {e0, row0, g0, 0}, {ne, rows, ng, 16}, bytes_read);
  const at::Tensor scales = read_block(sfile, sinfo, {e0, row0, g0}, {ne, rows, ng}, bytes_read);
  return dequantize_mxfp4(blocks, scales, dtype, tensor_description(bfile, bname))
      .narrow(-1, c0 - g0 * 32, nc);
}

}  // namespace

at::Tensor read_expert_part(const HfTensorSource& source, const HfExpertLayout& layout,
                            int64_t layer, ExpertParam p, c10::IntArrayRef shape,
                            c10::IntArrayRef offset, c10::IntArrayRef size, c10::ScalarType dtype,
                            const std::string& sizes_note, uint64_t* bytes_read) {
  const std::string prefix = hf_expert_prefix(layout, layer) + "experts.";
  const int64_t E = shape[0], e0 = offset[0], ne = size[0];
  const bool weight = p == ExpertParam::kW1 || p == ExpertParam::kW2 || p == ExpertParam::kW3;
  TORCH_CHECK(static_cast<int64_t>(shape.size()) == (weight ? 3 : 2) &&
                  offset.size() == shape.size() && size.size() == shape.size(),
              "read_expert_part: ", expert_param_name(p), " block of ", shape, " at ", offset,
              " of ", size);

  if (layout.gate != nullptr) {
    TORCH_CHECK(weight, "Hugging Face checkpoint layer ", layer, ": ", layout.block,
                " experts have no biases; expert parameter ", expert_param_name(p),
                " cannot be read");
    const char* which = p == ExpertParam::kW1   ? layout.gate
                        : p == ExpertParam::kW3 ? layout.up
                                                : layout.down;
    std::vector<at::Tensor> experts;
    for (int64_t e = e0; e < e0 + ne; ++e) {
      const std::string name = prefix + std::to_string(e) + "." + which + ".weight";
      const auto [file, info] = checked_expert_tensor(source, name, shape.slice(1), sizes_note);
      experts.push_back(
          read_block(file, info, offset.slice(1).vec(), size.slice(1).vec(), bytes_read));
    }
    return at::stack(experts);
  }

  // gpt-oss: stacked, gate and up interleaved by column, each matrix [in, out].
  switch (p) {
    case ExpertParam::kW1:
    case ExpertParam::kW3: {
      const int64_t I = shape[1], H = shape[2], i0 = offset[1], ni = size[1], h0 = offset[2],
                    nh = size[2], column = p == ExpertParam::kW1 ? 0 : 1;
      if (has_mxfp4_experts(source, layout, layer)) {
        // Blocks of rows [out = 2I] over groups of the inputs H.
        return read_mxfp4(source, prefix + "gate_up_proj", E, 2 * I, H, e0, ne, 2 * i0, 2 * ni, h0,
                          nh, dtype, sizes_note, bytes_read)
            .slice(1, column, c10::nullopt, 2)
            .contiguous();
      }
      const auto [file, info] =
          checked_expert_tensor(source, prefix + "gate_up_proj", {E, H, 2 * I}, sizes_note);
      return read_block(file, info, {e0, h0, 2 * i0}, {ne, nh, 2 * ni}, bytes_read)
          .slice(2, column, c10::nullopt, 2)
          .transpose(1, 2)
          .contiguous();
    }
    case ExpertParam::kW2: {
      const int64_t H = shape[1], I = shape[2], h0 = offset[1], nh = size[1], i0 = offset[2],
                    ni = size[2];
      if (has_mxfp4_experts(source, layout, layer)) {
        return read_mxfp4(source, prefix + "down_proj", E, H, I, e0, ne, h0, nh, i0, ni, dtype,
                          sizes_note, bytes_read);
      }
      const auto [file, info] =
          checked_expert_tensor(source, prefix + "down_proj", {E, I, H}, sizes_note);
      return read_block(file, info, {e0, i0, h0}, {ne, ni, nh}, bytes_read)
          .transpose(1, 2)
          .contiguous();
    }
    case ExpertParam::kB1:
    case ExpertParam::kB3: {
      const int64_t I = shape[1], i0 = offset[1], ni = size[1];
      const auto [file, info] =
          checked_expert_tensor(source, prefix + "gate_up_proj_bias", {E, 2 * I}, sizes_note);
      return read_block(file, info, {e0, 2 * i0}, {ne, 2 * ni}, bytes_read)
          .slice(1, p == ExpertParam::kB1 ? 0 : 1, c10::nullopt, 2)
          .contiguous();
    }
    case ExpertParam::kB2: {
      const auto [file, info] =
          checked_expert_tensor(source, prefix + "down_proj_bias", shape, sizes_note);
      return read_block(file, info, offset.vec(), size.vec(), bytes_read);
    }
  }
  TORCH_CHECK(false, "read_expert_part: unknown expert parameter");
}

std::vector<std::string> hf_expert_tensor_names(const HfTensorSource& source,
                                                const HfExpertLayout& layout, int64_t layer,
                                                int64_t num_experts, bool biases) {
  // hf_expert_tensors' names, from weights of the right number of experts (shapes only).
  const at::TensorOptions meta = at::TensorOptions().device(at::kMeta);
  ExpertWeights w;
  w.w1 = w.w3 = at::empty({num_experts, 1, 1}, meta);
  w.w2 = at::empty({num_experts, 1, 1}, meta);
  if (biases) w.b1 = w.b2 = w.b3 = at::empty({num_experts, 1}, meta);
  const bool mxfp4 = has_mxfp4_experts(source, layout, layer);
  std::vector<std::string> names;
  for (const auto& [name, tensor] : hf_expert_tensors(layout, layer, w)) {
    if (mxfp4 && (name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj"))) {
      names.push_back(name + "_blocks");
      names.push_back(name + "_scales");
    } else {
      names.push_back(name);
    }
  }
  return names;
}

std::vector<std::pair<std::string, at::Tensor>> hf_expert_tensors(const HfExpertLayout& layout,
                                                                  int64_t layer,
                                                                  const ExpertWeights& w) {
  const std::string prefix = hf_expert_prefix(layout, layer) + "experts.";
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (layout.gate != nullptr) {
    TORCH_CHECK(!w.b1.defined() && !w.b2.defined() && !w.b3.defined(), "Hugging Face layer ", layer,
                ": ", layout.block, " experts have no biases to save");
    for (int64_t e = 0; e < w.w1.size(0); ++e) {
      const std::string p = prefix + std::to_string(e) + ".";
      out.emplace_back(p + layout.gate + ".weight", w.w1[e].contiguous());
      out.emplace_back(p + layout.up + ".weight", w.w3[e].contiguous());
      out.emplace_back(p + layout.down + ".weight", w.w2[e].contiguous());
    }
    return out;
  }
  auto interleave = [](const at::Tensor& a, const at::Tensor& b) {
    return at::stack({a, b}, -1).flatten(-2).contiguous();
  };
  out.emplace_back(prefix + "gate_up_proj", interleave(w.w1.transpose(1, 2), w.w3.transpose(1, 2)));
  out.emplace_back(prefix + "down_proj", w.w2.transpose(1, 2).contiguous());
  if (w.b1.defined()) out.emplace_back(prefix + "gate_up_proj_bias", interleave(w.b1, w.b3));
  if (w.b2.defined()) out.emplace_back(prefix + "down_proj_bias", w.b2.contiguous());
  return out;
}

}  // namespace dtensor::models
