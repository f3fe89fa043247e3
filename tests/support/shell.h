#pragma once
// Runs a shell command for the tests of the apps, with its stdout and stderr together.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace dtensor::testing {

struct ShellResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// `command` under `timeout` (killed after `timeout_s`).
inline ShellResult shell(const std::string& command, int timeout_s = 240) {
  ShellResult r;
  const std::string line = "timeout " + std::to_string(timeout_s) + " " + command + " 2>&1";
  FILE* pipe = ::popen(line.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "cannot run " << command;
    return r;
  }
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

}  // namespace dtensor::testing
