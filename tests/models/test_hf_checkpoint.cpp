// Hugging Face Llama checkpoints in: tiny random LlamaForCausalLM models saved by
// save_pretrained (tests/fixtures/hf/make_fixtures.py: one file and a sharded index; tied and
// untied; 4, 2, 1 and 6 KV heads, so KV heads are replicated at some TP degrees; Llama 3.1 rope
// scaling in transformers 4's config form; float16, bfloat16 and float32 files) give HF's float32
// logits, and loaded in float64 HF's float64 logits within 1e-12, at TP=1..4, each rank reading
// only its slices; bad input fails naming the file and the tensor, and leaves a model untouched.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/dtensor.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/text/bpe_tokenizer.h"
#include "support/distributed.h"
#include "support/errors.h"
#include "support/fixture_copy.h"
#include "support/memory.h"
#include "support/temp_dir.h"

using namespace dtensor;
using namespace dtensor::models;
using namespace dtensor::testing;
namespace safetensors = dtensor::checkpoint::safetensors;
namespace fs = std::filesystem;

namespace {

const std::string kModels = std::string(DTENSOR_HF_FIXTURES) + "/models/";

struct Reference {
  at::Tensor tokens, logits, logits_f64;
};

// logits: HF's float32 forward; logits_f64: its float64 forward of the same stored weights
// (tests/fixtures/hf/make_f64_reference.py).
Reference reference(const std::string& name) {
  auto t = safetensors::load_file(kModels + name + "/reference.safetensors");
  return {t.at("tokens"), t.at("logits"), t.at("logits_f64")};
}

// Bytes a rank is expected to read: each tensor's local part under the plan, computed here from
// the plan's rules (not from the loader): vocab and head/FFN rows or columns split by
// torch.chunk, norms whole, and wk/wv whole when the KV heads do not split over tp.
uint64_t expected_bytes(const DecoderConfig& c, int64_t tp, int64_t rank, size_t elem,
                        uint64_t* replicated) {
  auto rows = [&](int64_t n) { return chunk_range(n, tp, rank).size; };
  const int64_t hd = c.head_dim(), kv = c.kv_heads() * hd;
  const bool kv_split = c.kv_heads() % tp == 0;
  uint64_t n = rows(c.vocab_size) * c.dim * (c.tie_embeddings ? 1 : 2);  // embedding, lm_head
  uint64_t rep = c.dim;                                                  // final norm
  for (int64_t l = 0; l < c.n_layers; ++l) {
    n += 2 * rows(c.n_heads * hd) * c.dim;     // wq rows, wo columns
    n += 3 * rows(c.hidden_dim()) * c.dim;     // w1, w3 rows, w2 columns
    n += kv_split ? 2 * rows(kv) * c.dim : 0;  // wk, wv rows
    rep += 2 * c.dim + (kv_split ? 0 : 2 * kv * c.dim);
  }
  *replicated = rep * elem;
  return (n + rep) * elem;
}

struct Fixture {
  std::string name;
  size_t elem;  // bytes per stored element
};

void PrintTo(const Fixture& f, std::ostream* os) { *os << f.name; }

// The model's dtype, and how close its logits must be to HF's in that dtype (relative to the
// largest logit).
struct Precision {
  at::ScalarType dtype;
  double tolerance;
};

void PrintTo(const Precision& p, std::ostream* os) { *os << p.dtype; }

class LogitsMatchHF : public ::testing::TestWithParam<std::tuple<Fixture, int, Precision>> {};

TEST_P(LogitsMatchHF, AtEveryTPDegree) {
  const auto [fixture, tp, precision] = GetParam();
  const std::string dir = kModels + fixture.name;
  const Reference ref = reference(fixture.name);
  const at::Tensor& want = precision.dtype == at::kDouble ? ref.logits_f64 : ref.logits;
  ASSERT_EQ(want.scalar_type(), precision.dtype);
  run_ranks(tp, [&, fixture = fixture, tp = tp, precision = precision](int rank) {
    auto mesh = init_device_mesh("cpu", {tp});
    HfModel hf = load_hf(dir, mesh, {.dtype = precision.dtype});
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = hf.model->forward(ref.tokens);
      if (is_dtensor(logits)) logits = full_tensor(logits);
    }
    EXPECT_EQ(logits.scalar_type(), precision.dtype);
    const double scale = want.abs().max().item<double>();
    EXPECT_GT(scale, 0.5);  // the reference is not trivially small
    const double error = (logits - want).abs().max().item<double>() / scale;
    EXPECT_LE(error, precision.tolerance) << fixture.name << " at tp=" << tp;

    uint64_t replicated = 0;
    const uint64_t expected = expected_bytes(hf.config, tp, rank, fixture.elem, &replicated);
    EXPECT_EQ(hf.stats.bytes_read, expected);
    // The target: about sharded / tp + replicated (uneven vocab chunks add at most a row).
    const uint64_t total = hf.stats.checkpoint_bytes;
    const uint64_t bound =
        (total - replicated) / tp + replicated + 2 * hf.config.dim * fixture.elem * (tp - 1);
    EXPECT_LE(hf.stats.bytes_read, bound);
    if (tp == 1) {
      EXPECT_EQ(hf.stats.bytes_read, total);
    }
    std::cout << fixture.name << " tp=" << tp << " " << precision.dtype << " rank " << rank
              << ": max |logits - HF| / max |HF| = " << error << "; read " << hf.stats.bytes_read
              << " of " << total << " bytes (replicated " << replicated << ", bound " << bound
              << ")\n";
  });
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, LogitsMatchHF,
    ::testing::Combine(::testing::Values(Fixture{"single", 2}, Fixture{"sharded", 2},
                                         Fixture{"tied_kv1", 4}, Fixture{"llama3_rope", 2}),
                       ::testing::Values(1, 2, 3, 4),
                       ::testing::Values(Precision{at::kFloat, 1e-5},
                                         Precision{at::kDouble, 1e-12})),
    [](const auto& info) {
      return std::get<0>(info.param).name + "_tp" + std::to_string(std::get<1>(info.param)) +
             (std::get<2>(info.param).dtype == at::kDouble ? "_f64" : "_f32");
    });

// Loading never holds the whole model: every byte a rank allocates through LibTorch while
// load_hf runs (counted by the CPU allocator, not reported by the loader) stays within the
// parameters it keeps (its shards plus the replicated norms and KV projections) and the
// transient copies of one tensor being read and converted. At TP=4 the whole model is 2.8 to
// 3.9 times what a rank keeps, so building the whole model first cannot pass (it peaked at
// 244-311 KB per rank against bounds of 70-87 KB).
class LoadAllocatesOnlyLocalParameters : public ::testing::TestWithParam<std::tuple<Fixture, int>> {
};

TEST_P(LoadAllocatesOnlyLocalParameters, PeakBytesPerRank) {
  const auto [fixture, tp] = GetParam();
  const std::string dir = kModels + fixture.name;
  run_ranks(tp, [&, fixture = fixture, tp = tp](int rank) {
    auto mesh = init_device_mesh("cpu", {tp});
    const int64_t elem = 4;  // loaded in float32
    int64_t peak = 0;
    HfModel hf;
    {
      CountCpuBytes count;
      hf = load_hf(dir, mesh, {.dtype = at::kFloat});
      peak = count.peak();
    }
    int64_t local = 0, largest = 0;
    for (const auto& p : hf.model->parameters()) {
      const int64_t n = (is_dtensor(p) ? local_tensor(p) : p).nbytes();
      local += n;
      largest = std::max(largest, n);
    }
    const DecoderConfig& c = hf.config;
    const int64_t whole = c.num_parameters() * elem;
    // One tensor in flight: its slice as stored (at most 4 bytes an element here) and the q/k
    // row permutation's copy; the rotary table (float64 cos and sin per position and frequency)
    // with its angles, cos and sin while it is stacked.
    const int64_t rope = 3 * c.max_seq_len * c.head_dim() * 8;
    const int64_t bound = local + 2 * largest + rope;
    EXPECT_LE(peak, bound) << fixture.name << " at tp=" << tp << " rank " << rank;
    if (tp == 4) {
      EXPECT_LT(bound, whole);  // so the bound does tell the two apart
    }
    std::cout << fixture.name << " tp=" << tp << " rank " << rank << ": peak " << peak
              << " bytes allocated while loading; keeps " << local << " (largest " << largest
              << "), whole model " << whole << ", bound " << bound << "\n";
  });
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, LoadAllocatesOnlyLocalParameters,
    ::testing::Combine(::testing::Values(Fixture{"single", 2}, Fixture{"sharded", 2},
                                         Fixture{"tied_kv1", 4}, Fixture{"llama3_rope", 2}),
                       ::testing::Values(1, 2, 4)),
    [](const auto& info) {
      return std::get<0>(info.param).name + "_tp" + std::to_string(std::get<1>(info.param));
    });

// Greedy generation with the KV cache continues every fixture's two prompts with exactly the
// tokens Hugging Face's generate() picks (tests/fixtures/hf/make_generate_reference.py), at TP=1,
// 2 and 3 (KV heads replicated on some).
class GreedyMatchesHFGenerate : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(GreedyMatchesHFGenerate, TokenForToken) {
  const auto [name, tp] = GetParam();
  std::ifstream in(std::string(DTENSOR_HF_FIXTURES) + "/generate_reference.json");
  ASSERT_TRUE(in) << "generate_reference.json is missing";
  const auto rows = nlohmann::json::parse(in).at(name);
  ASSERT_EQ(rows.size(), 2u);
  run_ranks(tp, [&, name = name, tp = tp](int) {
    auto mesh = init_device_mesh("cpu", {tp});
    HfLoadOptions options{.dtype = at::kFloat};
    options.tp.sequence_parallel = false;
    HfModel hf = load_hf(kModels + name, mesh, options);
    for (const auto& row : rows) {
      const auto prompt = row.at("prompt").get<std::vector<int64_t>>();
      const auto want = row.at("greedy").get<std::vector<int64_t>>();
      GenerateOptions g;
      g.max_new_tokens = static_cast<int64_t>(want.size());
      const GenerateResult got = generate(*hf.model, {prompt}, g);
      EXPECT_EQ(got.tokens.at(0), want) << name << " at tp=" << tp;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GreedyMatchesHFGenerate,
                         ::testing::Combine(::testing::Values("single", "sharded", "tied_kv1",
                                                              "llama3_rope"),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_tp" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(HfCheckpoint, ReadsTheConfig) {
  const auto hf = read_hf_config(kModels + "llama3_rope");
  const DecoderConfig& c = hf.config;
  EXPECT_EQ(hf.dtype, at::kBFloat16);
  EXPECT_EQ(c.dim, 48);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 12);
  EXPECT_EQ(c.kv_heads(), 6);
  EXPECT_EQ(c.hidden_dim(), 24);
  EXPECT_EQ(c.vocab_size, 300);
  EXPECT_EQ(c.max_seq_len, 64);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500.0);
  EXPECT_TRUE(c.tie_embeddings);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 16);
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 8.0);
  // Round trip through our JSON form.
  EXPECT_EQ(DecoderConfig::from_json(c.to_json()).to_json(), c.to_json());
  // transformers 5's form (rope_parameters, dtype).
  const auto v5 = read_hf_config(kModels + "single");
  EXPECT_EQ(v5.dtype, at::kHalf);
  EXPECT_FALSE(v5.config.rope_scaling.has_value());
  EXPECT_EQ(hf_parameter_name("layers.1.feed_forward.w2.weight"),
            "model.layers.1.mlp.down_proj.weight");
}

// The fixtures' prompt is the tokenizer's: our tokenizer gives the same ids (with the BOS).
TEST(HfCheckpoint, TokenizerGivesTheReferencePrompt) {
  const auto tok =
      text::BpeTokenizer::from_file(std::string(DTENSOR_HF_FIXTURES) + "/tokenizer.json");
  const auto ids = tok.encode("The quick brown fox jumps over the lazy dog. It's 2024!", true);
  ASSERT_GE(ids.size(), 12u);
  const at::Tensor tokens = reference("single").tokens;
  EXPECT_TRUE(
      at::equal(tokens[0], at::tensor(std::vector<int64_t>(ids.begin(), ids.begin() + 12))));
  EXPECT_EQ(tok.vocab_size(), read_hf_config(kModels + "single").config.vocab_size);
}

// A copy of a fixture to damage.
struct Copy : dtensor::testing::FixtureCopy {
  explicit Copy(const std::string& name) : FixtureCopy(kModels, name) {}
};

TEST(HfCheckpoint, BadInputNamesTheFileAndTensor) {
  {
    Copy c("sharded");
    fs::remove(c.dir + "/model-00002-of-00003.safetensors");
    const auto msg = message_of([&] { load_hf(c.dir); });
    EXPECT_CONTAINS(msg, "shard '" + c.dir + "/model-00002-of-00003.safetensors' is missing");
    EXPECT_CONTAINS(msg, "holds tensor \"model.layers.0.input_layernorm.weight\"");
  }
  {
    Copy c("single");
    auto j = c.config();
    j["intermediate_size"] = 36;
    c.set_config(j);
    const auto msg = message_of([&] { load_hf(c.dir); });
    EXPECT_CONTAINS(msg, "safetensors file '" + c.dir +
                             "/model.safetensors', tensor "
                             "\"model.layers.0.mlp.gate_proj.weight\"");
    EXPECT_CONTAINS(msg, "shape [24, 48] disagrees with config.json, which gives [36, 48]");
  }
  {
    Copy c("single");
    auto j = c.config();
    j["rope_parameters"]["rope_type"] = "longrope";
    c.set_config(j);
    const auto msg = message_of([&] { load_hf(c.dir); });
    EXPECT_CONTAINS(msg, c.dir + "/config.json");
    EXPECT_CONTAINS(msg,
                    "rope type \"longrope\" is not supported; supported: default, llama3, yarn");
  }
  {
    Copy c("llama3_rope");  // transformers 4's rope_scaling form
    auto j = c.config();
    j["rope_scaling"]["rope_type"] = "dynamic";
    c.set_config(j);
    EXPECT_CONTAINS(message_of([&] { read_hf_config(c.dir); }),
                    "rope type \"dynamic\" is not supported");
  }
  {
    Copy c("single");
    auto j = c.config();
    j["architectures"] = {"GemmaForCausalLM"};
    c.set_config(j);
    EXPECT_CONTAINS(message_of([&] { load_hf(c.dir); }),
                    "config.json': architecture GemmaForCausalLM is not supported; supported: "
                    "LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM, MistralForCausalLM");
  }
  {
    Copy c("sharded");
    const std::string shard = c.dir + "/model-00003-of-00003.safetensors";
    fs::resize_file(shard, fs::file_size(shard) - 100);
    const auto msg = message_of([&] { load_hf(c.dir); });
    EXPECT_CONTAINS(msg, "safetensors file '" + shard + "' is truncated");
    EXPECT_CONTAINS(msg, "holds tensor \"lm_head.weight\"");
  }
  {
    Copy c("single");
    fs::remove(c.dir + "/model.safetensors");
    EXPECT_CONTAINS(message_of([&] { load_hf(c.dir); }),
                    "has neither model.safetensors nor model.safetensors.index.json");
  }
}

// A failure on the last tensor read (lm_head, in the third shard) leaves every parameter as it
// was: all reads and checks come before the first copy.
TEST(HfCheckpoint, NothingIsHalfLoaded) {
  Copy c("sharded");
  const std::string shard = c.dir + "/model-00003-of-00003.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 2);
  Transformer model(read_hf_config(c.dir).config);
  model->init_weights(5);
  std::map<std::string, at::Tensor> before;
  for (const auto& p : model->named_parameters()) before[p.key()] = p.value().clone();
  EXPECT_CONTAINS(message_of([&] { load_hf_weights(c.dir, *model); }), "truncated");
  for (const auto& p : model->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value(), before.at(p.key()))) << p.key() << " changed";
  }
  // The undamaged checkpoint does change them.
  const HfLoadStats stats = load_hf_weights(kModels + "sharded", *model);
  EXPECT_EQ(stats.files, 3);
  for (const auto& p : model->named_parameters()) {
    EXPECT_FALSE(at::equal(p.value(), before.at(p.key()))) << p.key() << " not loaded";
  }
}

// Saved from TP=2 (through our float32 model), each fixture comes back bit for bit in its own
// dtype, under HF's names and row order, with a config.json that reads back to the same config.
// (tests/fixtures/hf/check_saved.py loads such a directory in transformers.)
TEST(HfCheckpoint, SavesWhatItLoadedFromAnyTPDegree) {
  for (const auto& [name, dtype] : std::vector<std::pair<std::string, at::ScalarType>>{
           {"single", at::kHalf}, {"tied_kv1", at::kFloat}, {"llama3_rope", at::kBFloat16}}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    const std::string out = tmp.file("saved");
    run_ranks(2, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {2});
      HfModel hf = load_hf(kModels + name, mesh, {.dtype = at::kFloat});
      save_hf(out, *hf.model, {.dtype = dtype});
    });
    const auto original = safetensors::load_file(kModels + name + "/model.safetensors");
    safetensors::File saved(out + "/model.safetensors");
    EXPECT_EQ(saved.metadata().at("format"), "pt");
    ASSERT_EQ(saved.tensors().size(), original.size());
    for (const auto& [tensor, value] : original) {
      EXPECT_TRUE(at::equal(saved.tensor(tensor), value)) << tensor;
    }
    const auto back = read_hf_config(out), orig = read_hf_config(kModels + name);
    EXPECT_EQ(back.config.to_json(), orig.config.to_json());
    EXPECT_EQ(back.dtype, dtype);
    // For tests/fixtures/hf/check_saved.py: keep the directories to load them in transformers.
    if (const char* keep = std::getenv("DTENSOR_KEEP_HF_SAVED")) {
      fs::create_directories(keep);
      fs::copy(out, std::string(keep) + "/" + name,
               fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    }
  }
}

}  // namespace
