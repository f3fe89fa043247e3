// dtensor_generate: text generation with a dtensor_train checkpoint, a Hugging Face checkpoint
// of any supported family or a preset's random weights, tensor-parallel over the ranks of a
// launch (dtrun -n 2 dtensor_generate ...) or alone. See --help.
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/tokenizer.h"
#include "dtensor/util/error_message.h"
#include "dtensor/comm/failure.h"
#include "dtensor/comm/process_group.h"
#include "dtensor/mesh/device_mesh.h"
#include "dtensor/models/generate.h"
#include "dtensor/ops/layout_invariant.h"
#include "dtensor/text/bpe_tokenizer.h"
#include "model_source.h"

namespace {

using namespace dtensor;

struct Options {
  generate_app::ModelSource source;
  std::vector<std::string> prompts;
  models::GenerateOptions generate;
  int threads = 1;
  int64_t layout_invariant = 0;  // --layout-invariant P; 0: off
};

// A byte model's token is one byte; ids past 255 (presets with larger vocabularies) print as
// <id>.
std::string token_text(int64_t token) {
  if (token >= 0 && token < train::ByteTokenizer::kVocabSize)
    return train::ByteTokenizer().decode({token});
  return "<" + std::to_string(token) + ">";
}

int run(const Options& o, const comm::LaunchEnv& env) {
  at::set_num_threads(o.threads);
  // Alone (no launcher variables) any free port does for the store.
  if (env.world_size == 1 && env.source == "default" && std::getenv("MASTER_PORT") == nullptr)
    ::setenv("MASTER_PORT", "0", 1);
  comm::init_process_group();
  const DeviceMesh mesh = init_device_mesh("cpu", {comm::get_world_size()}, {"tp"});
  const bool rank0 = env.rank == 0;
  // Every rank refuses alike, before loading anything.
  const int64_t p = o.layout_invariant;
  if (p > 0 && ((p & (p - 1)) != 0 || p % mesh.size() != 0))
    throw std::invalid_argument("--layout-invariant " + std::to_string(p) +
                                ": P must be a power of two that the TP degree (" +
                                std::to_string(mesh.size()) + " ranks) divides, e.g. 4");
  auto loaded = generate_app::load_model(o.source, mesh);
  const auto& config = loaded.model->config();
  if (rank0)
    std::cerr << "dtensor_generate: " << loaded.description << "; " << config.num_parameters()
              << " parameters, TP=" << mesh.size()
              << (p > 0 ? ", layout-invariant (" + std::to_string(p) + " segments)" : "") << "\n";

  // A Hugging Face model brings its BPE tokenizer; the bundled models use bytes.
  std::optional<text::BpeTokenizer> bpe;
  if (!loaded.tokenizer_json.empty()) bpe = text::BpeTokenizer::from_file(loaded.tokenizer_json);
  const train::ByteTokenizer bytes;
  auto encode = [&](const std::string& p) {
    return bpe ? bpe->encode(p, /*add_special_tokens=*/true) : bytes.encode(p);
  };
  auto decode = [&](const std::vector<int64_t>& ids) {
    if (bpe) return bpe->decode(ids, /*skip_special_tokens=*/true);
    std::string out;
    for (int64_t t : ids) out += token_text(t);
    return out;
  };
  std::vector<std::vector<int64_t>> prompts;
  for (const auto& p : o.prompts) prompts.push_back(encode(p));
  models::GenerateOptions g = o.generate;
  // One prompt streams as it comes; several are printed whole at the end, one per line. A BPE
  // token may end inside a UTF-8 character: print what the whole output decodes to, less what
  // was printed already.
  const bool stream = rank0 && prompts.size() == 1;
  std::vector<int64_t> streamed;
  std::string printed;
  if (stream) {
    std::cout << o.prompts[0] << std::flush;
    g.on_token = [&](int64_t, int64_t token) {
      streamed.push_back(token);
      const std::string now = decode(streamed);
      if (now.size() > printed.size() && now.compare(0, printed.size(), printed) == 0) {
        std::cout << now.substr(printed.size()) << std::flush;
        printed = now;
      }
    };
  }
  std::optional<ops::LayoutInvariantMode> invariant;
  if (p > 0) invariant.emplace(p);  // the same logits and tokens at every TP degree dividing P
  const auto result = models::generate(*loaded.model, prompts, g);
  invariant.reset();
  if (rank0) {
    if (stream) std::cout << "\n";
    for (size_t b = 0; !stream && b < prompts.size(); ++b) {
      std::cout << o.prompts[b] << decode(result.tokens[b]) << "\n";
    }
    auto rate = [](int64_t n, double s) { return s > 0 ? static_cast<double>(n) / s : 0.0; };
    std::fprintf(stderr,
                 "prompt: %lld tokens in %.3f s (%.1f tokens/s); output: %lld tokens in %.3f s "
                 "(%.1f tokens/s, %lld decode steps)\n",
                 static_cast<long long>(result.prompt_tokens), result.prefill_seconds,
                 rate(result.prompt_tokens, result.prefill_seconds),
                 static_cast<long long>(result.new_tokens),
                 result.prefill_seconds + result.decode_seconds,
                 rate(result.new_tokens, result.prefill_seconds + result.decode_seconds),
                 static_cast<long long>(result.decode_steps));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const auto env = comm::read_launch_env();
  Options o;
  CLI::App app{
      "Generates text with a trained, Hugging Face or random-weight model, tensor-parallel over\n"
      "the ranks of a launch (dtrun -n 2 dtensor_generate --checkpoint runs/demo --prompt\n"
      "\"Once\"). Rank 0 streams the continuation to stdout and prints prompt and output\n"
      "tokens/s to stderr.",
      "dtensor_generate"};
  auto* model_group = app.add_option_group("model", "where the weights come from (one of)");
  model_group
      ->add_option("--checkpoint", o.source.checkpoint,
                   "a dtensor_train output directory (its newest checkpoint), a checkpoints "
                   "directory or a .safetensors file")
      ->check(CLI::ExistingPath);
  model_group->add_option("--model", o.source.hf_model,
                          "a Hugging Face checkpoint directory (config.json, safetensors)");
  model_group->add_option("--preset", o.source.preset, "random weights for a preset (no download)")
      ->check(CLI::IsMember(models::DecoderConfig::preset_names()));
  model_group->require_option(1);
  app.add_option("--prompt", o.prompts, "prompt text; repeat for a batch")->required();
  app.add_option("--max-new-tokens", o.generate.max_new_tokens, "tokens to generate per prompt")
      ->default_val(64)
      ->check(CLI::NonNegativeNumber);
  app.add_option("--temperature", o.generate.temperature, "0: greedy")
      ->default_val(0.8)
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", o.generate.top_k, "sample among the k most likely tokens; 0: all")
      ->default_val(0)
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", o.generate.top_p, "nucleus sampling mass; 1: off")
      ->default_val(1.0)
      ->check(CLI::Range(0.0, 1.0) & CLI::PositiveNumber);
  app.add_option("--seed", o.source.seed,
                 "sampling seed (the same tokens at every TP degree), and the preset's weights")
      ->default_val(0);
  app.add_option("--stop-token", o.generate.stop_tokens, "token id that ends a prompt's output");
  app.add_option("--dtype", o.source.dtype, "float32 or float64 (default: the checkpoint's)")
      ->check(CLI::IsMember({"float32", "float64"}));
  app.add_option("--threads", o.threads, "intra-op threads per rank")
      ->default_val(1)
      ->check(CLI::PositiveNumber);
  app.add_option("--layout-invariant", o.layout_invariant,
                 "P (a power of two): the same logits and tokens, bit for bit, at every TP degree "
                 "dividing P (each row-parallel sum in P fixed segments, added in one order), and "
                 "each decode step's logits those of re-running the whole sequence")
      ->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Usage errors are the same on every rank: rank 0 explains them, the others wait a moment
    // so a launcher that stops all ranks when one fails lets rank 0 finish saying why.
    if (env.rank == 0) return app.exit(e);
    if (e.get_exit_code() != 0) std::this_thread::sleep_for(std::chrono::seconds(2));
    return e.get_exit_code();
  }
  o.generate.seed = o.source.seed;
  try {
    return run(o, env);
  } catch (const std::exception& e) {
    const std::string message = util::error_message(e);
    std::cerr << "dtensor_generate: error on rank " << env.rank << ": " << message << std::endl;
    comm::report_failure(message);
    return 1;
  }
}
