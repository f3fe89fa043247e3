// dtensor_train --hf: fine-tuning a Hugging Face checkpoint. The Trainer on the committed Qwen3
// (q/k norms, TP=2) and Qwen2 (q/k/v biases, tied embedding, sliding window, TP=3) fixtures takes
// 3 AdamW steps in float64 equal to one device's, gradients and weights included; the app under
// dtrun fine-tunes tests/fixtures/hf/finetune/qwen3 (with its tokenizer.json) at TP=2, passes
// its own --verify-tp1 and writes an HF directory that our loader reads back with the trained
// weights; bad input fails with one message naming the file or flag.
//
// DTENSOR_KEEP_FINETUNED=DIR keeps that directory in DIR with our logits beside it, for
// tests/fixtures/hf/check_finetuned.py (transformers, not needed by CI).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/corpus.h"
#include "common/options.h"
#include "common/run_config.h"
#include "common/trainer.h"
#include "dtensor/checkpoint/checkpoint.h"
#include "dtensor/checkpoint/checkpoint_manager.h"
#include "dtensor/checkpoint/safetensors.h"
#include "dtensor/dtensor.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/text/bpe_tokenizer.h"
#include "support/distributed.h"
#include "support/files.h"
#include "support/fixture_copy.h"
#include "support/shell.h"
#include "support/temp_dir.h"
#include "train/metrics.h"

using namespace dtensor;
using namespace dtensor::train;
using dtensor::testing::FixtureCopy;
using dtensor::testing::read_file;
using dtensor::testing::run_ranks;
using dtensor::testing::shell;
using dtensor::testing::TempDir;
namespace fs = std::filesystem;
namespace safetensors = dtensor::checkpoint::safetensors;

namespace {

const std::string kFixtures = DTENSOR_HF_FIXTURES;
const std::string kFamilies = kFixtures + "/family_models/";
const std::string kFinetune = kFixtures + "/finetune/qwen3";

RunConfig hf_config(const std::string& dir, int64_t world, int64_t dp_shard = 1) {
  TrainOptions o;
  o.hf_dir = dir;
  o.dp_shard = dp_shard;
  o.steps = 3;
  o.batch_size = 2;
  o.seq_len = 12;  // splits over TP 2 and 3 (sequence parallel)
  o.lr = 1e-2;     // large enough that the weights visibly move in 3 steps
  o.warmup = 0;
  o.dtype = "float64";
  return resolve_run_config(o, world);
}

at::Tensor whole(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t) : t; }

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// 3 steps at TP=world against one device, from the checkpoint's weights: losses, gradient norms,
// then every gradient and weight; `must_check` names parameters whose gradients must be among
// them (q/k norms, biases).
void expect_finetune_like_one_device(const std::string& family, int world,
                                     const std::vector<std::string>& must_check,
                                     const std::string& models = kFamilies, int dp_shard = 1) {
  const std::string dir = models + family;
  run_ranks(world, [&](int rank) {
    const RunConfig cfg = hf_config(dir, world, dp_shard);
    ASSERT_EQ(cfg.tp, world / dp_shard);
    // Random tokens: every id of the vocabulary is possible.
    std::vector<int64_t> tokens(4000);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    const at::Tensor ids = at::randint(cfg.model.vocab_size, {4000}, gen, at::kLong);
    for (int64_t i = 0; i < 4000; ++i) tokens[i] = ids[i].item<int64_t>();
    const BatchSampler batches(&tokens, cfg.batch_size, cfg.seq_len, cfg.seed, kTrainStream);

    Trainer tp(cfg, make_train_mesh(cfg));
    Trainer one(one_device(cfg), std::nullopt);
    // Both start from the checkpoint: HF's float64 logits of it.
    const auto ref = safetensors::load_file(dir + "/reference.safetensors");
    if (ref.count("logits_f64")) {
      at::NoGradGuard no_grad;
      const at::Tensor logits = whole(tp.model().forward(ref.at("tokens")));
      EXPECT_LE(max_diff(logits, ref.at("logits_f64")), 1e-9);
    }
    for (int64_t step = 0; step < cfg.steps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      const auto a = tp.train_step(step, batches.get(step));
      const auto b = one.train_step(step, batches.get(step));
      EXPECT_NEAR(a.loss, b.loss, 1e-9);
      EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-9);
    }
    std::map<std::string, at::Tensor> ref_params;
    for (const auto& p : one.model().named_parameters()) ref_params[p.key()] = p.value();
    const auto original = models::load_hf(dir, std::nullopt, {.dtype = at::kDouble});
    std::map<std::string, at::Tensor> start;
    for (const auto& p : original.model->named_parameters()) start[p.key()] = p.value();
    std::set<std::string> checked;
    double worst = 0;
    for (const auto& p : tp.model().named_parameters()) {
      SCOPED_TRACE(p.key());
      const at::Tensor& r = ref_params.at(p.key());
      ASSERT_TRUE(p.value().grad().defined());
      const double g = max_diff(whole(p.value().grad()), r.grad());
      const double w = max_diff(whole(p.value()), r);
      EXPECT_LE(g, 1e-9);
      EXPECT_LE(w, 1e-9);
      worst = std::max({worst, g, w});
      EXPECT_GT(max_diff(r, start.at(p.key())), 1e-6) << "not trained";
      checked.insert(p.key());
    }
    for (const auto& name : must_check) EXPECT_TRUE(checked.count(name)) << name;
    if (rank == 0)
      std::printf("%s TP=%d vs one device after 3 steps: max |difference| %.3g\n", family.c_str(),
                  world, worst);
  });
}

std::string train_command(int ranks, const std::string& args) {
  std::ostringstream c;  // not operator+ chains: GCC 12 warns about them (-Warray-bounds)
  if (ranks > 0) c << DTRUN_PATH << " -n " << ranks << " --backend gloo ";
  c << DTENSOR_TRAIN_PATH << " " << args;
  return c.str();
}

// The error checks: one message, exit 2, no stack trace or uncaught exception.
void expect_clear_error(const dtensor::testing::ShellResult& r, const std::string& what) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(what), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
}

// Our loader reads OUT/hf back: every weight moved from the checkpoint's, and they are the weights
// training ended with (its final training checkpoint, --save-final). Returns tokens of a line
// and the logits of the reloaded model.
std::pair<at::Tensor, at::Tensor> expect_export_is_the_trained_model(const std::string& out) {
  const std::string hf = out + "/hf";
  auto tuned = models::load_hf(hf);
  auto original = models::load_hf(kFinetune);
  std::map<std::string, at::Tensor> start;
  for (const auto& p : original.model->named_parameters()) start[p.key()] = p.value();
  for (const auto& p : tuned.model->named_parameters())
    EXPECT_GT(max_diff(p.value(), start.at(p.key())), 1e-6) << p.key() << " did not change";
  const auto latest = checkpoint::CheckpointManager(out + "/checkpoints").latest();
  EXPECT_TRUE(latest.has_value());
  if (!latest) return {};
  models::Transformer trained(tuned.config);
  checkpoint::load_checkpoint(*latest, *trained);

  const auto tok = text::BpeTokenizer::from_file(hf + "/tokenizer.json");
  const std::vector<int64_t> ids = tok.encode("The tokenizer should round-trip every line.", true);
  const at::Tensor tokens = at::tensor(ids, at::kLong).unsqueeze(0);
  at::NoGradGuard no_grad;
  const at::Tensor logits = tuned.model->forward(tokens);
  EXPECT_TRUE(logits.isfinite().all().item<bool>());
  EXPECT_EQ(max_diff(logits, trained->forward(tokens)), 0.0);
  EXPECT_GT(max_diff(logits, original.model->forward(tokens)), 1e-4);
  return {tokens, logits};
}

}  // namespace

TEST(TrainFinetune, Qwen3AtTp2EqualsOneDeviceQkNormGradientsIncluded) {
  expect_finetune_like_one_device(
      "qwen3", 2,
      {"layers.0.attention.q_norm.weight", "layers.1.attention.k_norm.weight", "norm.weight"});
}

TEST(TrainFinetune, Qwen2AtTp3EqualsOneDeviceBiasGradientsIncluded) {
  expect_finetune_like_one_device("qwen2", 3,
                                  {"layers.0.attention.wq.bias", "layers.0.attention.wk.bias",
                                   "layers.1.attention.wv.bias", "tok_embeddings.weight"});
}

// Mixture-of-experts checkpoints at TP 2: the loss includes router_aux_loss_coef times the
// auxiliary loss, the experts split over the ranks (sequence parallel between blocks). Qwen3-MoE
// has a dense layer among its sparse ones, gpt-oss sinks, biases and a router bias. Under
// FSDP 2 x TP 2 the auxiliary loss is pooled over dp (the whole batch's, as one device's), and the
// experts' rows are sharded over dp.
TEST(TrainFinetune, MoeCheckpointsAtTp2AndFsdp2xTp2EqualOneDevice) {
  const std::string moe = kFixtures + "/moe_models/";
  expect_finetune_like_one_device(
      "qwen3_moe", 2,
      {"layers.0.moe.router.weight", "layers.0.moe.experts.w2", "layers.1.feed_forward.w1.weight"},
      moe);
  const std::vector<std::string> oss = {"layers.0.attention.sinks", "layers.1.moe.router.bias",
                                        "layers.0.moe.experts.b2", "layers.1.moe.experts.b1"};
  expect_finetune_like_one_device("gpt_oss", 2, oss, moe);
  expect_finetune_like_one_device("gpt_oss", 4, oss, moe, /*dp_shard=*/2);
}

// The app on a mixture-of-experts checkpoint (Qwen3-MoE, with a byte-level tokenizer.json of
// its 256 ids, tests/fixtures/hf/make_byte_tokenizer.py) at TP 2: passes its --verify-tp1, logs
// the auxiliary loss and the tokens per expert, and writes an HF directory holding the trained
// experts that our loader reads back.
TEST(TrainFinetune, AppFineTunesAMoeCheckpointAtTp2AndWritesAnHfDirectory) {
  const std::string moe = kFixtures + "/moe_models/";
  FixtureCopy copy(moe, "qwen3_moe");
  fs::copy_file(moe + "byte_tokenizer.json", copy.dir + "/tokenizer.json");
  TempDir tmp;
  const std::string out = tmp.file("run");
  std::ostringstream args;
  args << "--hf " << copy.dir << " --data " << kFixtures << "/corpus.txt"
       << " --steps 2 --batch-size 4 --seq-len 16 --lr 1e-2 --warmup 0 --eval-batches 1"
       << " --verify-tp1 --out " << out;
  const auto r = shell(train_command(2, args.str()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verify-tp1: PASS"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("  aux "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("  tokens/expert "), std::string::npos) << r.output;
  const auto tuned = models::load_hf(out + "/hf");
  const auto original = models::load_hf(moe + "qwen3_moe");
  EXPECT_EQ(tuned.config.to_json(), original.config.to_json());
  const auto start = original.model->named_parameters();
  for (const auto& p : tuned.model->named_parameters())
    EXPECT_GT(max_diff(p.value(), start[p.key()]), 1e-6) << p.key() << " did not change";
}

TEST(TrainFinetune, AppFineTunesAtTp2AndWritesAnHfDirectoryThatReloads) {
  TempDir tmp;
  const std::string out = tmp.file("run");
  std::ostringstream args;
  args << "--hf " << kFinetune << " --data " << kFixtures << "/corpus.txt"
       << " --steps 3 --batch-size 4 --seq-len 16 --lr 1e-2 --warmup 0 --eval-batches 1"
       << " --save-final --verify-tp1 --out " << out;
  const auto r = shell(train_command(2, args.str()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("Qwen3ForCausalLM " + kFinetune), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tokenizer.json)"), std::string::npos) << r.output;  // data row
  EXPECT_NE(r.output.find("verify-tp1: PASS"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hf export: " + out + "/hf"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(out + "/metrics.csv"));
  EXPECT_TRUE(fs::exists(out + "/loss.svg"));

  // The directory: the checkpoint's architecture and shape, its tokenizer files byte for byte.
  const std::string hf = out + "/hf";
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    EXPECT_EQ(read_file(hf + "/" + f), read_file(kFinetune + "/" + f)) << f;
  const auto config = nlohmann::json::parse(read_file(hf + "/config.json"));
  EXPECT_EQ(config["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(config["vocab_size"], 300);
  EXPECT_EQ(config["max_position_embeddings"], 64);  // not --seq-len

  const auto [tokens, logits] = expect_export_is_the_trained_model(out);
  if (const char* keep = std::getenv("DTENSOR_KEEP_FINETUNED")) {
    checkpoint::remove_directory(keep);
    fs::copy(hf, keep, fs::copy_options::recursive);
    safetensors::save_file({{"tokens", tokens}, {"logits", logits.contiguous()}},
                           std::string(keep) + "/dtensor_logits.safetensors");
  }
}

// Interrupted after step 2 and resumed from its checkpoint (not from the HF weights), the run
// repeats the uninterrupted one: the same losses and the same exported weights, bit for bit.
TEST(TrainFinetune, ResumedFineTuneRepeatsTheUninterruptedRun) {
  TempDir tmp;
  std::ostringstream common;
  common << "--hf " << kFinetune << " --data " << kFixtures << "/corpus.txt"
         << " --steps 4 --batch-size 4 --seq-len 16 --lr 1e-2 --warmup 0 --eval-batches 1";
  const std::string whole = tmp.file("whole"), split = tmp.file("split");
  auto r = shell(train_command(2, common.str() + " --out " + whole));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = shell(train_command(2, common.str() + " --stop-at 2 --ckpt-every 2 --out " + split));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = shell(train_command(2, common.str() + " --resume --out " + split));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed"), std::string::npos) << r.output;
  const auto a = read_metrics_csv(whole + "/metrics.csv");
  const auto b = read_metrics_csv(split + "/metrics.csv");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(b[i].loss, a[i].loss) << "step " << i + 1;
  EXPECT_EQ(read_file(split + "/hf/model.safetensors"), read_file(whole + "/hf/model.safetensors"));
}

// The same fine-tuning under FSDP (with bf16 mixed precision and activation checkpointing, and
// over TP on 4 ranks) and under pipeline stages: each passes its --verify-tp1 and exports the
// weights it trained.
TEST(TrainFinetune, AppFineTunesUnderFsdpAndPipelineAndExportsTheTrainedWeights) {
  const std::vector<std::pair<int, std::string>> runs = {{2, "--dp-shard 2 --ac full"},
                                                         {2, "--dp-shard 2 --mixed-precision bf16"},
                                                         {2, "--pp 2 --microbatches 2"},
                                                         {4, "--dp-shard 2"}};  // FSDP x TP
  for (const auto& [ranks, flags] : runs) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks " + flags);
    TempDir tmp;
    const std::string out = tmp.file("run");
    std::ostringstream args;
    args << "--hf " << kFinetune << " --data " << kFixtures << "/corpus.txt"
         << " --steps 3 --batch-size 4 --seq-len 16 --lr 1e-2 --warmup 0 --eval-batches 1"
         << " --save-final --verify-tp1 --out " << out << " " << flags;
    const auto r = shell(train_command(ranks, args.str()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("verify-tp1: PASS"), std::string::npos) << r.output;
    expect_export_is_the_trained_model(out);
  }
}

// A checkpoint whose output head is tied to the embedding (Qwen's and Gemma's small models) under
// FSDP: the head computes with the embedding's gathered weight. Before, it kept the weight it
// was built with while FSDP swapped the embedding's for its shard, and trained away from one
// device.
TEST(TrainFinetune, TiedCheckpointFineTunesUnderFsdpAsOnOneDevice) {
  FixtureCopy copy(kFixtures + "/finetune/", "qwen3");
  auto j = copy.config();
  j["tie_word_embeddings"] = true;
  copy.set_config(j);
  TempDir tmp;
  std::ostringstream args;
  args << "--hf " << copy.dir << " --data " << kFixtures << "/corpus.txt"
       << " --steps 3 --batch-size 4 --seq-len 16 --lr 1e-2 --warmup 0 --eval-batches 1"
       << " --verify-tp1 --dp-shard 2 --out " << tmp.file("run");
  const auto r = shell(train_command(2, args.str()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verify-tp1: PASS"), std::string::npos) << r.output;
}

TEST(TrainFinetune, BadInputFailsWithOneMessageNamingTheFileOrFlag) {
  TempDir tmp;
  const std::string out = " --steps 1 --out " + tmp.file("run");
  {  // no tokenizer.json
    FixtureCopy copy(kFixtures + "/finetune/", "qwen3");
    fs::remove(copy.dir + "/tokenizer.json");
    expect_clear_error(shell(train_command(0, "--hf " + copy.dir + out)),
                       "no tokenizer file '" + copy.dir + "/tokenizer.json'");
  }
  {  // an architecture the loader does not know
    FixtureCopy copy(kFixtures + "/finetune/", "qwen3");
    auto j = copy.config();
    j["architectures"] = {"GPT2LMHeadModel"};
    copy.set_config(j);
    const auto r = shell(train_command(2, "--hf " + copy.dir + out));
    expect_clear_error(r, copy.dir + "/config.json");
    EXPECT_NE(r.output.find("GPT2LMHeadModel"), std::string::npos) << r.output;
  }
  // A flag that contradicts the checkpoint's config.json.
  for (const char* flag : {"--preset tiny", "--layers 4", "--config x.json"}) {
    expect_clear_error(
        shell(train_command(0, "--hf " + kFinetune + " " + flag + out)),
        std::string(flag).substr(0, std::string(flag).find(' ')) + " contradicts --hf");
  }
  expect_clear_error(shell(train_command(0, "--hf " + tmp.file("nowhere") + out)),
                     "--hf: no such directory");
  expect_clear_error(shell(train_command(0, "--hf " + kFinetune + " --seq-len 65" + out)),
                     "max_position_embeddings 64 of " + kFinetune + "/config.json");
  expect_clear_error(shell(train_command(0, "--hf-out x" + out)), "--hf-out");
}

TEST(TrainFinetune, OptionsDocumentAndCheckTheHfFlags) {
  const std::string help = kUsage;
  EXPECT_NE(help.find("--hf DIR"), std::string::npos);
  EXPECT_NE(help.find("--hf-out DIR"), std::string::npos);
  auto parse = [](std::vector<std::string> args, int& code) {
    args.insert(args.begin(), "dtensor_train");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    return parse_args(static_cast<int>(argv.size()), argv.data(), code, /*quiet=*/true);
  };
  int code = 0;
  const auto o = parse({"--hf", "ckpt", "--hf-out", "tuned", "--seq-len", "32"}, code);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->hf_dir, "ckpt");
  EXPECT_EQ(o->hf_out, "tuned");
  for (const char* flag : {"--preset", "--dim", "--heads", "--kv-heads", "--ffn-dim", "--vocab"}) {
    code = 0;
    EXPECT_FALSE(
        parse({"--hf", "ckpt", flag, flag == std::string("--preset") ? "tiny" : "256"}, code))
        << flag;
    EXPECT_EQ(code, 2) << flag;
  }
}
