#pragma once
// The command lines of dtrun, dtensor_train, dtensor_demo and the benchmarks, parsed by CLI11
// with one set of conventions: `--name value` and `--name=value`; `-h`/`--help` prints the
// program's help text on stdout and exits 0; a usage error prints one line naming the option
// on stderr ("dtensor_train: --steps expects an integer, got 'three'") and exits 2.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace dtensor::cli {

// Checks of an option's text. Their messages follow the option's name in the error line.
CLI::Validator integer(int64_t min, int64_t max = std::numeric_limits<int64_t>::max());
CLI::Validator number(double min, double max = std::numeric_limits<double>::infinity(),
                      bool min_open = false);  // finite numbers in [min, max] ((min, max])
CLI::Validator one_of(std::vector<std::string> choices);
CLI::Validator non_empty();

// Parses argv with `app` (named after the program). Returns nullopt to go on, or the exit code
// to leave with after printing: 0 after --help printed `help`, 2 after a usage error. `quiet`
// prints nothing (ranks other than 0 would repeat rank 0's message). Without `command`,
// arguments that are not options are errors; with it, the first one and everything after it
// (or after "--") is a program to run, stored there, and options after it are the program's.
std::optional<int> parse(CLI::App& app, int argc, char** argv, const std::string& help,
                         bool quiet = false, std::vector<std::string>* command = nullptr);

// Prints a usage error found after parsing in the same format and returns 2.
int usage_error(const CLI::App& app, const std::string& message, bool quiet = false);

}  // namespace dtensor::cli
