#include "hf_export.h"

#include <exception>
#include <filesystem>

#include "common/trainer.h"
#include "dtensor/checkpoint/rank0_outcome.h"
#include "dtensor/models/hf_checkpoint.h"

namespace dtensor::train {

namespace fs = std::filesystem;

const std::vector<std::string>& hf_tokenizer_files() {
  static const std::vector<std::string> files = {"tokenizer.json",
                                                 "tokenizer_config.json",
                                                 "special_tokens_map.json",
                                                 "added_tokens.json",
                                                 "vocab.json",
                                                 "merges.txt",
                                                 "tokenizer.model",
                                                 "chat_template.jinja",
                                                 "generation_config.json"};
  return files;
}

std::vector<std::string> export_hf_checkpoint(Trainer& trainer, const std::string& dir) {
  const RunConfig& config = trainer.config();
  models::HfSaveOptions options;
  options.architecture = config.hf_architecture;
  options.dtype = config.hf_dtype;  // a bfloat16 checkpoint stays bfloat16
  if (trainer.pipelined()) {
    Trainer one = trainer.gather_to_one_device();
    models::save_hf(dir, one.model(), options);
  } else {
    models::save_hf(dir, trainer.model(), options);
  }
  std::vector<std::string> copied;
  std::exception_ptr error;
  if (checkpoint::detail::global_rank() == 0) {
    try {
      for (const auto& name : hf_tokenizer_files()) {
        const fs::path from = fs::path(config.hf_dir) / name;
        if (!fs::is_regular_file(from)) continue;
        fs::copy_file(from, fs::path(dir) / name, fs::copy_options::overwrite_existing);
        copied.push_back(name);
      }
    } catch (...) {
      error = std::current_exception();
    }
  }
  checkpoint::detail::share_rank0_outcome(error, "copying the tokenizer files to '" + dir + "'");
  return copied;
}

}  // namespace dtensor::train
