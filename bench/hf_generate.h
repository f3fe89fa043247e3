#pragma once
// The transformers side of the generation benchmarks (bench_generate, bench_cuda): the model and
// the prompts saved to a temporary folder, bench/hf_generate.py run on them, its result line read.
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "bench_support.h"
#include "dtensor/checkpoint/remove_directory.h"
#include "dtensor/models/hf_checkpoint.h"
#include "dtensor/models/transformer.h"

namespace dtensor::bench {

// The key=value fields of hf_generate.py's "ok ..." line (prefill_tps, decode_tps, tokens), or
// nullopt with the reason in `why` (transformers missing, the script failed). `command_prefix`
// goes before the script (environment and interpreter); `script_args` after the common ones.
inline std::optional<std::map<std::string, std::string>> hf_generate(
    models::TransformerImpl& model, const std::vector<std::vector<int64_t>>& prompts,
    const std::string& command_prefix, const std::string& script, int64_t new_tokens,
    const std::string& script_args, std::string* why) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("hf_generate." + std::to_string(::getpid()));
  fs::create_directories(dir);
  struct Cleanup {
    fs::path dir;
    ~Cleanup() {
      try {
        checkpoint::remove_directory(dir);
      } catch (const fs::filesystem_error&) {
      }
    }
  } cleanup{dir};
  models::save_hf((dir / "model").string(), model);
  {
    std::ofstream out(dir / "prompts.txt");
    for (const auto& row : prompts) {
      for (size_t i = 0; i < row.size(); ++i) out << (i ? " " : "") << row[i];
      out << "\n";
    }
  }
  const std::string cmd =
      "TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 " + command_prefix + " " +
      find_script(script) + " --model " + (dir / "model").string() + " --prompts " +
      (dir / "prompts.txt").string() + " --new " + std::to_string(new_tokens) + " " + script_args;
  const auto r = run_command(cmd);
  const std::string out = r ? r->out : "";
  const auto at = out.rfind("ok ");
  if (!r || r->status != 0 || at == std::string::npos) {
    *why = out.empty() ? "the script failed (see above)" : out;
    return std::nullopt;
  }
  std::map<std::string, std::string> fields;
  std::istringstream in(out.substr(at + 3));
  std::string field;
  while (in >> field) {
    const auto eq = field.find('=');
    if (eq != std::string::npos) fields[field.substr(0, eq)] = field.substr(eq + 1);
  }
  return fields;
}

}  // namespace dtensor::bench
