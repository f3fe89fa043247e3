// dtensor_generate end to end: the built binary (DTENSOR_GENERATE_PATH) under the built launcher
// (DTRUN_PATH). Sampled text is the same at TP=1 and TP=2, from random preset weights and from a
// checkpoint dtensor_train (DTENSOR_TRAIN_PATH) wrote; usage errors are explained.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/shell.h"
#include "support/temp_dir.h"

using dtensor::testing::TempDir;

namespace {

using Result = dtensor::testing::ShellResult;
using dtensor::testing::shell;

// dtensor_generate without dtrun (one process, no process group).
Result generate_alone(const std::string& args) {
  std::ostringstream command;  // not operator+ chains: GCC 12 warns about them (-Warray-bounds)
  command << DTENSOR_GENERATE_PATH << " " << args;
  return shell(command.str());
}

Result generate(int ranks, const std::string& args) {
  std::ostringstream command;
  command << DTRUN_PATH << " -n " << ranks << " --backend gloo " << DTENSOR_GENERATE_PATH << " "
          << args;
  return shell(command.str());
}

// The generated text: rank 0's output without the lines that name the TP degree or timings.
std::string text_of(const std::string& output) {
  std::istringstream in(output);
  std::string line, text;
  while (std::getline(in, line)) {
    if (line.find("dtensor_generate:") != std::string::npos) continue;
    if (line.find("tokens/s") != std::string::npos) continue;
    text += line + "\n";
  }
  return text;
}

}  // namespace

TEST(GenerateApp, PresetTextIsTheSameAtTP1AndTP2) {
  const std::string args =
      "--preset tiny --seed 3 --prompt Hello --max-new-tokens 24 --temperature 0.8 --top-p 0.9";
  const Result one = generate(1, args), two = generate(2, args);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(one.output.find("Hello"), std::string::npos) << one.output;
  EXPECT_NE(two.output.find("output: 24 tokens"), std::string::npos) << two.output;
  EXPECT_NE(two.output.find("TP=2"), std::string::npos) << two.output;
  EXPECT_EQ(text_of(one.output), text_of(two.output));
  // Another seed, other text.
  const Result other = generate(1, "--preset tiny --seed 4 --prompt Hello --max-new-tokens 24");
  ASSERT_EQ(other.exit_code, 0) << other.output;
  EXPECT_NE(text_of(one.output), text_of(other.output));
}

// --model of each mixture-of-experts family (transformers-made fixtures without a tokenizer:
// bytes): greedy text the same at TP 1 and 2 (gpt-oss also 4; experts split over the ranks).
TEST(GenerateApp, MoeModelsGenerateTheSameGreedyTextAtTP1And2) {
  for (const std::string family : {"qwen3_moe", "mixtral", "gpt_oss"}) {
    SCOPED_TRACE(family);
    const std::string args = "--model " + std::string(DTENSOR_HF_FIXTURES) + "/moe_models/" +
                             family + " --prompt Hello --max-new-tokens 8 --temperature 0";
    const Result one = generate(1, args);
    ASSERT_EQ(one.exit_code, 0) << one.output;
    EXPECT_NE(one.output.find("output: 8 tokens"), std::string::npos) << one.output;
    for (int tp : family == "gpt_oss" ? std::vector<int>{2, 4} : std::vector<int>{2}) {
      const Result r = generate(tp, args);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_EQ(text_of(r.output), text_of(one.output)) << "tp=" << tp;
    }
  }
}

// --layout-invariant P reaches the generator (whose bits tests/ops/test_layout_invariant.cpp
// compares); a P the TP degree does not divide is refused on every rank before loading.
TEST(GenerateApp, LayoutInvariantTextIsTheSameAtTP1AndTP2) {
  const std::string args =
      "--preset tiny --seed 3 --prompt Hello --max-new-tokens 16 --temperature 0.8 "
      "--layout-invariant 2";
  const Result one = generate(1, args), two = generate(2, args);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("layout-invariant (2 segments)"), std::string::npos) << two.output;
  EXPECT_EQ(text_of(one.output), text_of(two.output));
  const Result bad = generate(2, "--preset tiny --prompt Hello --layout-invariant 3");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--layout-invariant 3: P must be a power of two"), std::string::npos)
      << bad.output;
}

TEST(GenerateApp, TrainerCheckpointLoadsAtAnyTP) {
  TempDir dir;
  std::ostringstream train;
  train << DTRUN_PATH << " -n 2 --backend gloo " << DTENSOR_TRAIN_PATH
        << " --preset tiny --steps 3 --save-final --out " << dir.file("run");
  const Result trained = shell(train.str());
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string args = "--checkpoint " + dir.file("run") +
                           " --prompt 'The ' --prompt 'A longer prompt' --max-new-tokens 12";
  const Result one = generate(1, args), two = generate(2, args);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("checkpoint " + dir.file("run")), std::string::npos) << two.output;
  EXPECT_EQ(text_of(one.output), text_of(two.output));
}

TEST(GenerateApp, UsageErrorsAreExplained) {
  const Result help = generate_alone("--help");
  EXPECT_EQ(help.exit_code, 0);
  for (const char* option : {"--checkpoint", "--model", "--preset", "--prompt", "--max-new-tokens",
                             "--temperature", "--top-k", "--top-p", "--seed"})
    EXPECT_NE(help.output.find(option), std::string::npos) << option << " missing from --help";
  const Result none = generate_alone("--prompt hi");
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.output.find("model"), std::string::npos) << none.output;
  const Result missing = generate_alone("--checkpoint /nonexistent --prompt hi");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("/nonexistent"), std::string::npos) << missing.output;
}

// A checkpoint the library cannot load is explained in one line per rank: no C++ stack trace.
TEST(GenerateApp, AnUnloadableCheckpointIsExplainedWithoutAStackTrace) {
  TempDir dir;
  {
    std::ofstream config(dir.file("config.json"));
    config << R"({"architectures": ["NoSuchModelForCausalLM"], "model_type": "no_such_model"})";
  }
  const Result r = generate(2, "--model " + dir.path().string() + " --prompt hi");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("NoSuchModelForCausalLM"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
}
