#pragma once
// A copy of a checkpoint fixture folder in a fresh temporary folder, for tests that damage it
// (a config key changed, a file removed) and check the error.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "support/temp_dir.h"

namespace dtensor::testing {

struct FixtureCopy {
  TempDir tmp;
  std::string dir;  // the copy of `models` + `name`
  FixtureCopy(const std::string& models, const std::string& name) : dir(tmp.file(name)) {
    std::filesystem::copy(models + name, dir, std::filesystem::copy_options::recursive);
  }
  nlohmann::json config() const {
    std::ifstream in(dir + "/config.json");
    return nlohmann::json::parse(in);
  }
  void set_config(const nlohmann::json& j) const {
    std::ofstream(dir + "/config.json") << j.dump();
  }
};

}  // namespace dtensor::testing
