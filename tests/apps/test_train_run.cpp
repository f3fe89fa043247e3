// dtensor_train end to end: the built binary (DTENSOR_TRAIN_PATH) under the built launcher
// (DTRUN_PATH) on 2 CPU ranks, with the tiny preset and a few steps. The TP=2 losses are
// checked against one device by the program's own --verify-tp1 (plain LibTorch, same seed
// and batches), a resumed run against an uninterrupted one.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/errors.h"
#include "support/files.h"
#include "support/temp_dir.h"
#include "train/metrics.h"

using dtensor::testing::read_file;
using dtensor::testing::TempDir;

namespace {

namespace fs = std::filesystem;
using dtensor::train::MetricsRow;
using dtensor::train::read_metrics_csv;

struct Result {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs argv with stdout+stderr in a file; kills it after `timeout_s`.
Result run(const std::vector<std::string>& args, double timeout_s = 240) {
  const fs::path log =
      fs::temp_directory_path() / ("dtensor_train_test_" + std::to_string(::getpid()) + ".log");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  Result r;
  if (posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ) != 0) {
    ADD_FAILURE() << "cannot start " << args[0];
    return r;
  }
  posix_spawn_file_actions_destroy(&actions);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGTERM);  // dtrun stops its ranks
      ::waitpid(pid, &status, 0);
      ADD_FAILURE() << args[0] << " did not finish within " << timeout_s << " s";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  fs::remove(log);
  return r;
}

// dtrun -n <ranks> dtensor_train --preset tiny <args>
Result train(int ranks, std::vector<std::string> args) {
  // Forked ranks on Gloo: these tests are about the trainer, not the engine dtrun picks.
  std::vector<std::string> cmd = {DTRUN_PATH,  "-n",   std::to_string(ranks),
                                  "--backend", "gloo", DTENSOR_TRAIN_PATH,
                                  "--preset",  "tiny"};
  cmd.insert(cmd.end(), args.begin(), args.end());
  return run(cmd);
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t p = text.find(part); p != std::string::npos; p = text.find(part, p + 1)) ++n;
  return n;
}

}  // namespace

TEST(TrainRun, TwoRanksTrainTinyModelAndMatchOneDevice) {
  TempDir dir;
  const auto r =
      train(2, {"--steps", "5", "--eval-every", "2", "--out", dir.file("run"), "--verify-tp1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto rows = read_metrics_csv(dir.file("run/metrics.csv"));
  ASSERT_EQ(rows.size(), 5u) << r.output;
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].step, static_cast<int64_t>(i + 1));
    EXPECT_TRUE(std::isfinite(rows[i].loss));
    EXPECT_GT(rows[i].loss, 0);
    EXPECT_TRUE(std::isfinite(rows[i].grad_norm));
    EXPECT_GT(rows[i].tokens_per_s, 0);
    // Evaluated every 2 steps and at the end.
    EXPECT_EQ(rows[i].val_loss.has_value(), i == 1 || i == 3 || i == 4) << "step " << i + 1;
  }
  // A fresh byte-level model starts near ln(256) + 1/2: the final norm gives unit-RMS features
  // and the output weights have std 1/sqrt(dim) (torchtitan's init), so the logits have unit
  // variance, which costs about half a nat over uniform predictions.
  EXPECT_NEAR(rows[0].loss, std::log(256.0) + 0.5, 0.4);
  EXPECT_NE(read_file(dir.file("run/loss.svg")).find("<polyline"), std::string::npos);
  EXPECT_NE(read_file(dir.file("run/config.json")).find("\"tp\": 2"), std::string::npos);
  EXPECT_NE(r.output.find("verify-tp1: PASSED"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("summary"), std::string::npos) << r.output;
}

// --preset tiny-moe: experts split over 2 ranks train as one device does (the loss includes the
// auxiliary loss), and each logged line adds the auxiliary loss and the fewest and most tokens an
// expert got since the previous line.
TEST(TrainRun, TinyMoeTrainsAtTp2AsOneDeviceAndLogsTheRouting) {
  TempDir dir;
  const auto r =
      run({DTRUN_PATH, "-n", "2", "--backend", "gloo", DTENSOR_TRAIN_PATH, "--preset", "tiny-moe",
           "--steps", "4", "--log-every", "2", "--out", dir.file("run"), "--verify-tp1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verify-tp1: PASSED"), std::string::npos) << r.output;
  // Steps 1, 2 and 4 are logged.
  EXPECT_EQ(count(r.output, "  aux "), 3u) << r.output;
  EXPECT_EQ(count(r.output, "  tokens/expert "), 3u) << r.output;
  EXPECT_NE(read_file(dir.file("run/config.json")).find("\"num_experts\":4"), std::string::npos);
}

// --cp 2: each sequence split over 2 ranks (head-tail, the ring) trains as one device does
// (--verify-tp1: plain attention over whole rows); --pack-documents at cp 2 x tp 2 with the
// all-gather packs the paragraphs of a file and shows the balance of the attention work.
TEST(TrainRun, ContextParallelTrainsAsOneDeviceAndPacksDocuments) {
  TempDir dir;
  auto r = train(2, {"--cp", "2", "--steps", "3", "--seq-len", "32", "--out", dir.file("run"),
                     "--verify-tp1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verify-tp1: PASSED"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CP=2 (ring of keys and values); per rank 4 x 16 token slots"),
            std::string::npos)
      << r.output;
  std::string text;
  for (int d = 0; d < 300; ++d)
    text += std::string(3 + (d * 37) % 90, static_cast<char>('a' + d % 26)) + "\n\n";
  dtensor::testing::write_file(dir.file("docs.txt"), text);
  r = train(4, {"--cp", "2", "--cp-rotate", "allgather", "--pack-documents", "--data",
                dir.file("docs.txt"), "--steps", "2", "--seq-len", "64", "--batch-size", "2",
                "--out", dir.file("packed")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("CP=2 (all-gather of keys and values)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("packed documents, balance max/mean 1.0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(head-tail "), std::string::npos) << r.output;
  // Too short a sequence for the ranks: one clear line, before the ranks meet.
  r = train(2, {"--cp", "2", "--seq-len", "1", "--steps", "1"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count(r.output, "the sequence of 1 tokens is shorter than cp=2"), 1u) << r.output;
}

// --ep 2: the experts sharded over the 2 TP ranks (2 of 4 whole experts per rank) train as one
// device does in both dispatch modes (capacity with room for every choice), and the header says
// so; a model without experts is refused in one line before anything is built.
TEST(TrainRun, TinyMoeWithExpertParallelismTrainsAsOneDeviceInBothDispatchModes) {
  for (const std::string dispatch : {"dropless", "capacity"}) {
    TempDir dir;
    const auto r = run({DTRUN_PATH, "-n", "2", "--backend", "gloo", DTENSOR_TRAIN_PATH, "--preset",
                        "tiny-moe", "--ep", "2", "--moe-dispatch", dispatch, "--capacity-factor",
                        "4", "--steps", "3", "--out", dir.file("run"), "--verify-tp1"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("verify-tp1: PASSED"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("2 of 4 experts per rank, " + dispatch + " dispatch"),
              std::string::npos)
        << r.output;
  }
  TempDir dir;
  const auto dense = run({DTRUN_PATH, "-n", "2", "--backend", "gloo", DTENSOR_TRAIN_PATH,
                          "--preset", "tiny", "--ep", "2", "--steps", "1", "--out", dir.file("d")});
  EXPECT_NE(dense.exit_code, 0);
  EXPECT_NE(dense.output.find("expert parallelism (ep=2) needs mixture-of-experts layers"),
            std::string::npos)
      << dense.output;
}

TEST(TrainRun, ResumedRunRepeatsTheUninterruptedRunExactly) {
  TempDir dir;
  const auto whole = train(2, {"--steps", "6", "--out", dir.file("whole")});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto first =
      train(2, {"--steps", "6", "--stop-at", "3", "--ckpt-every", "3", "--out", dir.file("split")});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_TRUE(fs::exists(dir.file("split/checkpoints/step_000003.safetensors"))) << first.output;
  ASSERT_EQ(read_metrics_csv(dir.file("split/metrics.csv")).size(), 3u);
  const auto second =
      train(2, {"--steps", "6", "--resume", "--out", dir.file("split"), "--verify-tp1"});
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("verify-tp1: PASSED"), std::string::npos) << second.output;

  const auto a = read_metrics_csv(dir.file("whole/metrics.csv"));
  const auto b = read_metrics_csv(dir.file("split/metrics.csv"));
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);  // the first run's 3 rows and the resumed run's 3
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(b[i].step, a[i].step);
    EXPECT_EQ(b[i].loss, a[i].loss) << "step " << i + 1;  // same numbers, not just close
    EXPECT_EQ(b[i].grad_norm, a[i].grad_norm) << "step " << i + 1;
    EXPECT_EQ(b[i].lr, a[i].lr) << "step " << i + 1;
  }

  // The checkpoint holds global tensors: one rank continues the TP=2 run to the same losses
  // (within float32 rounding of the different reductions).
  const auto alone =
      train(1, {"--steps", "6", "--resume", dir.file("split/checkpoints/step_000003.safetensors"),
                "--out", dir.file("alone")});
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  const auto c = read_metrics_csv(dir.file("alone/metrics.csv"));
  ASSERT_EQ(c.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(c[i].step, a[i + 3].step);
    EXPECT_NEAR(c[i].loss, a[i + 3].loss, 1e-4 * a[i + 3].loss) << "step " << c[i].step;
  }
}

TEST(TrainRun, BadSettingsFailOnceBeforeTheRanksMeet) {
  // 4 heads cannot be split over 3 ranks: every rank exits 2, only rank 0 says why.
  auto r = train(3, {"--steps", "2"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  size_t said = 0;
  for (size_t p = r.output.find("valid tp degrees"); p != std::string::npos;
       p = r.output.find("valid tp degrees", p + 1)) {
    ++said;
  }
  EXPECT_EQ(said, 1u) << r.output;
  r = train(2, {"--stpes", "2"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("unknown option '--stpes'"), std::string::npos) << r.output;
}

TEST(TrainRun, RunsAloneWithoutALauncher) {
  TempDir dir;
  const auto r =
      run({DTENSOR_TRAIN_PATH, "--preset", "tiny", "--steps", "2", "--out", dir.file("alone")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_metrics_csv(dir.file("alone/metrics.csv")).size(), 2u);
  EXPECT_NE(r.output.find("TP=1"), std::string::npos) << r.output;
}

// The step whose memory is measured: "step 2 allocated up to 2.48 MiB per rank ..." (bytes).
double step_peak_bytes(const std::string& output) {
  const std::string key = "allocated up to ";
  const size_t at = output.find(key);
  if (at == std::string::npos) return -1;
  std::istringstream in(output.substr(at + key.size()));
  double v = 0;
  std::string unit;
  in >> v >> unit;
  const double scale = unit == "GiB"   ? 1 << 30
                       : unit == "MiB" ? 1 << 20
                       : unit == "KiB" ? 1 << 10
                                       : 1;
  return v * scale;
}

// The progress display and the summary give what a step allocates beyond the state, measured
// by the CPU allocator in the run's second step; full activation checkpointing lowers it (the
// blocks' activations are recomputed in backward instead of kept).
TEST(TrainRun, AStepsPeakAllocationIsMeasuredAndActivationCheckpointingLowersIt) {
  TempDir dir;
  double peak[2] = {0, 0};
  for (int ac = 0; ac < 2; ++ac) {
    const auto r = run({DTENSOR_TRAIN_PATH, "--preset", "tiny", "--steps", "2", "--ac",
                        ac ? "full" : "none", "--out", dir.file(ac ? "ac" : "no_ac")});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(count(r.output, "allocates up to"), 1u) << r.output;  // the summary
    peak[ac] = step_peak_bytes(r.output);
    EXPECT_GT(peak[ac], 0) << r.output;
  }
  EXPECT_LT(peak[1], 0.8 * peak[0]) << "AC full " << peak[1] << " bytes, none " << peak[0];
}

TEST(TrainRun, PlanFileEqualToTheBuiltInPlanTrainsToTheSameLosses) {
  TempDir dir;
  const std::string plan = std::string(DTENSOR_TRAIN_PLANS) + "/llama_tp.json";
  const auto builtin = train(2, {"--steps", "2", "--out", dir.file("builtin")});
  ASSERT_EQ(builtin.exit_code, 0) << builtin.output;
  const auto from_file = train(2, {"--steps", "2", "--plan", plan, "--out", dir.file("file")});
  ASSERT_EQ(from_file.exit_code, 0) << from_file.output;
  EXPECT_CONTAINS(from_file.output, "TP=2 (plan " + plan + ")");
  EXPECT_CONTAINS(read_file(dir.file("file/config.json")), "\"plan\": \"" + plan + "\"");
  const auto a = read_metrics_csv(dir.file("builtin/metrics.csv"));
  const auto b = read_metrics_csv(dir.file("file/metrics.csv"));
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(b[i].loss, a[i].loss) << "step " << i + 1;  // the same plan: the same numbers
    EXPECT_EQ(b[i].grad_norm, a[i].grad_norm) << "step " << i + 1;
  }
}

TEST(TrainRun, PlanFileWithAnotherPlanMatchesOneDevice) {
  // Megatron's plan as the file gives it: activations replicated between blocks and the logits
  // gathered (no sequence or loss parallelism).
  TempDir dir;
  std::ofstream(dir.file("megatron.json")) << R"json({"sequence_parallel": false, "plan": {
    "tok_embeddings": "RowwiseParallel(input_layouts=Replicate())",
    "output": "ColwiseParallel(output_layouts=Replicate())",
    "layers.*.attention.wq": "ColwiseParallel()",
    "layers.*.attention.wk": "ColwiseParallel()",
    "layers.*.attention.wv": "ColwiseParallel()",
    "layers.*.attention.wo": "RowwiseParallel()",
    "layers.*.feed_forward.w1": "ColwiseParallel()",
    "layers.*.feed_forward.w2": "RowwiseParallel()",
    "layers.*.feed_forward.w3": "ColwiseParallel()"
  }})json";
  const auto r = train(2, {"--steps", "3", "--plan", dir.file("megatron.json"), "--out",
                           dir.file("run"), "--verify-tp1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "verify-tp1: PASSED");
}

TEST(TrainRun, BadPlanFileFailsOnceNamingTheFileAndTheEntry) {
  TempDir dir;
  const std::string bad = dir.file("bad.json");
  std::ofstream(bad) << R"json({"sequence_parallel": false, "plan": {
    "layers.*.attention.wq": "ColwiseParallel()",
    "layers.*.attention.wo": "RowwiseParallel(output_layout=Shard(1))"}})json";
  auto r = train(2, {"--steps", "1", "--plan", bad, "--out", dir.file("run")});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::string named = "--plan " + bad + ": entry \"layers.*.attention.wo\"";
  EXPECT_EQ(count(r.output, named), 1u) << r.output;  // said once, by rank 0
  EXPECT_CONTAINS(r.output, "unknown style arguments: output_layout");

  const std::string broken = dir.file("broken.json");
  std::ofstream(broken) << R"json({"plan": {"output": )json";
  r = train(2, {"--steps", "1", "--plan", broken, "--out", dir.file("run")});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_CONTAINS(r.output, "--plan " + broken + ": not valid JSON");

  const std::string not_text = dir.file("not_text.json");
  std::ofstream(not_text) << R"json({"sequence_parallel": false, "plan": {"output": 3}})json";
  r = train(2, {"--steps", "1", "--plan", not_text, "--out", dir.file("run")});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_CONTAINS(r.output,
                  "--plan " + not_text + ": entry \"output\": the style must be a string");

  r = train(2, {"--steps", "1", "--plan", dir.file("missing.json"), "--out", dir.file("run")});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_CONTAINS(r.output, "--plan " + dir.file("missing.json") + ": cannot open the file");

  // A plan says whether it shards the sequence: a file of styles alone is refused naming the key.
  const std::string unsaid = dir.file("unsaid.json");
  std::ofstream(unsaid) << R"json({"plan": {"output": "ColwiseParallel()"}})json";
  r = train(2, {"--steps", "1", "--plan", unsaid, "--out", dir.file("run")});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_CONTAINS(r.output, "--plan " + unsaid + ": \"sequence_parallel\" must be true or false");
}

// --print-plan writes the plan a launch would apply as a --plan file: the shipped llama_tp.json
// is what it prints for the tiny preset (the built-in plan, from the parameter schema).
TEST(TrainRun, PrintPlanWritesTheBuiltInPlanAsAPlanFile) {
  const auto r = run({DTENSOR_TRAIN_PATH, "--preset", "tiny", "--print-plan"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, read_file(std::string(DTENSOR_TRAIN_PLANS) + "/llama_tp.json"));
  const auto megatron =
      run({DTENSOR_TRAIN_PATH, "--preset", "tiny", "--no-sequence-parallel", "--print-plan"});
  ASSERT_EQ(megatron.exit_code, 0) << megatron.output;
  EXPECT_CONTAINS(megatron.output, "\"sequence_parallel\": false");
  EXPECT_EQ(megatron.output.find("SequenceParallel"), std::string::npos) << megatron.output;
}

// bf16 mixed precision inside pipeline stages (pp x dp_shard on 4 ranks): the blocks compute in
// bfloat16 and the loss in float32, so the losses stay within bfloat16's reach of one device in
// float32 (the 1% --verify-tp1 allows) but are not float32's own: before, the stages' FSDP units
// took no mixed-precision options and trained in float32 (relative difference 8e-8).
TEST(TrainRun, PipelineWithFsdpTrainsInBf16MixedPrecision) {
  TempDir dir;
  const auto r = train(4, {"--preset", "tiny", "--pp", "2", "--dp-shard", "2", "--mixed-precision",
                           "bf16", "--steps", "4", "--out", dir.file("run"), "--verify-tp1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "verify-tp1: PASSED");
  const std::string key = "largest relative difference ";
  const auto at = r.output.find(key);
  ASSERT_NE(at, std::string::npos) << r.output;
  const double diff = std::stod(r.output.substr(at + key.size()));
  EXPECT_GT(diff, 1e-5) << "bfloat16 left no trace: the stages computed in float32\n" << r.output;
  EXPECT_LT(diff, 1e-2) << r.output;
}

// --pp 2 on 4 ranks (TP=2 inside the stages): the header shows the layout, every progress line
// the measured bubble next to the formula, and --verify-tp1 passes in float64 (1e-9). Its
// checkpoint resumes at another layout (--pp 2 alone, 1F1B) to the one-device losses.
TEST(TrainRun, PipelineStagesTrainResumeAndMatchOneDevice) {
  TempDir dir;
  const auto r = train(4, {"--pp",           "2", "--schedule", "gpipe",
                           "--microbatches", "2", "--dtype",    "float64",
                           "--steps",        "4", "--stop-at",  "2",
                           "--ckpt-every",   "2", "--progress", "lines",
                           "--log-every",    "1", "--out",      dir.file("run"),
                           "--verify-tp1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("PP=2 x TP=2 (blocks per stage 1 + 1; schedule gpipe, 2 micro-batches"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("bubble (pp-1)/(M+pp-1) = 33%"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "(formula 33%)"), 2u) << r.output;  // steps 1 and 2
  EXPECT_NE(r.output.find("loss PP=2 x TP=2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("verify-tp1: PASSED"), std::string::npos) << r.output;
  EXPECT_NE(read_file(dir.file("run/config.json")).find("\"pp\": 2"), std::string::npos);

  const auto resumed = train(2, {"--pp", "2", "--dtype", "float64", "--steps", "4", "--resume",
                                 "--out", dir.file("run"), "--verify-tp1"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("schedule 1f1b"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("(step 2)"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("verify-tp1: PASSED"), std::string::npos) << resumed.output;
  EXPECT_EQ(read_metrics_csv(dir.file("run/metrics.csv")).size(), 4u);

  // Stages replicated over plain data parallelism (pp x dp on 4 ranks): each stage's gradients
  // averaged over dp once per step; the losses are one device's.
  const auto replicated = train(4, {"--pp", "2", "--dp", "2", "--dtype", "float64", "--steps", "2",
                                    "--out", dir.file("replicated"), "--verify-tp1"});
  ASSERT_EQ(replicated.exit_code, 0) << replicated.output;
  EXPECT_CONTAINS(replicated.output, "PP=2 x DP=2 x TP=1 (blocks per stage 1 + 1");
  EXPECT_CONTAINS(replicated.output, "verify-tp1: PASSED");

  // With FSDP inside the stages (pp x dp_shard on 4 ranks) and the interleaved schedule; its
  // checkpoint (FSDP shards gathered) resumes at (pp, tp) = (2, 1) with 1F1B and takes the
  // steps one device takes without stopping.
  const auto sharded = train(4, {"--preset",       "tiny",
                                 "--stop-at",      "2",
                                 "--ckpt-every",   "2",
                                 "--pp",           "2",
                                 "--dp-shard",     "2",
                                 "--schedule",     "interleaved",
                                 "--layers",       "4",
                                 "--microbatches", "2",
                                 "--dtype",        "float64",
                                 "--steps",        "4",
                                 "--progress",     "lines",
                                 "--log-every",    "1",
                                 "--out",          dir.file("sharded"),
                                 "--verify-tp1"});
  ASSERT_EQ(sharded.exit_code, 0) << sharded.output;
  EXPECT_CONTAINS(sharded.output,
                  "PP=2 x FSDP=2 x TP=1 (blocks per stage 1 + 1 + 1 + 1; schedule interleaved (2 "
                  "stages per rank, round-robin), 2 micro-batches of 1");
  EXPECT_CONTAINS(sharded.output, "bubble (pp-1)/(vM+pp-1) = 20%");
  EXPECT_CONTAINS(sharded.output, "verify-tp1: PASSED");
  const auto moved =
      train(2, {"--preset", "tiny", "--layers", "4", "--pp", "2", "--dtype", "float64", "--steps",
                "4", "--resume", "--out", dir.file("sharded")});
  ASSERT_EQ(moved.exit_code, 0) << moved.output;
  const auto straight = train(1, {"--preset", "tiny", "--layers", "4", "--dtype", "float64",
                                  "--steps", "4", "--out", dir.file("straight")});
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto resumed_rows = read_metrics_csv(dir.file("sharded/metrics.csv"));
  const auto straight_rows = read_metrics_csv(dir.file("straight/metrics.csv"));
  ASSERT_EQ(resumed_rows.size(), 4u) << moved.output;
  ASSERT_EQ(straight_rows.size(), 4u) << straight.output;
  for (size_t i = 0; i < 4; ++i)
    EXPECT_NEAR(resumed_rows[i].loss, straight_rows[i].loss, 1e-9 * straight_rows[i].loss)
        << "step " << i + 1;
}
