#include "cli.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <iostream>

namespace dtensor::cli {
namespace {

std::string in_quotes(const std::string& s) { return "'" + s + "'"; }

std::string shortest(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

template <typename T>
bool parse_whole(const std::string& text, T& out) {
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end;
}

// CLI11's messages, reworded as "<option> <what is wrong>".
std::string reworded(const CLI::ParseError& e) {
  const std::string what = e.what();
  const auto colon = what.find(": ");
  if (dynamic_cast<const CLI::ValidationError*>(&e) && colon != std::string::npos) {
    return what.substr(0, colon) + " " + what.substr(colon + 2);  // "--steps: x" -> "--steps x"
  }
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e)) {
    if (what.ends_with(" missing") && colon != std::string::npos) {
      return what.substr(0, colon) + " needs a value";
    }
    const std::string flag_override = " was given a disallowed flag override";
    if (what.ends_with(flag_override)) {
      std::string name = what.substr(0, what.size() - flag_override.size());
      if (!name.starts_with("-")) name = (name.size() == 1 ? "-" : "--") + name;
      return name + " takes no value";
    }
  }
  return what;
}

}  // namespace

CLI::Validator integer(int64_t min, int64_t max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        int64_t v = 0;
        if (!parse_whole(text, v)) return "expects an integer, got " + in_quotes(text);
        if (v >= min && v <= max) return "";
        if (max == std::numeric_limits<int64_t>::max()) {
          return "must be at least " + std::to_string(min) + ", got " + text;
        }
        return "must be an integer from " + std::to_string(min) + " to " + std::to_string(max) +
               ", got " + text;
      },
      "INT", "integer");
}

CLI::Validator number(double min, double max, bool min_open) {
  return CLI::Validator(
      [min, max, min_open](std::string& text) -> std::string {
        double v = 0;
        // from_chars accepts "inf" and "nan": only finite numbers are settings.
        if (!parse_whole(text, v) || !std::isfinite(v)) {
          return "expects a number, got " + in_quotes(text);
        }
        if (v >= min && v <= max && !(min_open && v == min)) return "";
        if (std::isinf(max)) {
          return std::string(min_open ? "must be above " : "must be at least ") + shortest(min) +
                 ", got " + text;
        }
        return "must be in " + std::string(min_open ? "(" : "[") + shortest(min) + ", " +
               shortest(max) + "], got " + text;
      },
      "NUMBER", "number");
}

CLI::Validator one_of(std::vector<std::string> choices) {
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
  return CLI::Validator(
      [choices, list](std::string& text) -> std::string {
        if (std::ranges::find(choices, text) != choices.end()) return "";
        return "expects one of " + list + ", got " + in_quotes(text);
      },
      "{" + list + "}", "one_of");
}

CLI::Validator non_empty() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        return text.empty() ? "expects a non-empty value" : "";
      },
      "TEXT", "non_empty");
}

int usage_error(const CLI::App& app, const std::string& message, bool quiet) {
  if (!quiet) {
    std::cerr << app.get_name() << ": " << message << "\n(run " << app.get_name()
              << " --help for the options)" << std::endl;
  }
  return 2;
}

std::optional<int> parse(CLI::App& app, int argc, char** argv, const std::string& help, bool quiet,
                         std::vector<std::string>* command) {
  app.allow_extras();
  // An option given twice takes its last value (a script's defaults, then the user's).
  for (CLI::Option* option : app.get_options()) {
    option->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
  // A program's own options follow it: stop at the first argument that is not ours.
  if (command) app.prefix_command();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    if (!quiet) std::cout << help << std::flush;
    return 0;
  } catch (const CLI::ParseError& e) {
    return usage_error(app, reworded(e), quiet);
  }
  std::vector<std::string> rest = app.remaining();
  if (command && !rest.empty() && rest.front() == "--") {
    command->assign(rest.begin() + 1, rest.end());
    return std::nullopt;
  }
  if (!rest.empty() && rest.front().size() > 1 && rest.front().starts_with("-")) {
    return usage_error(app, "unknown option " + in_quotes(rest.front()), quiet);
  }
  if (command) {
    *command = std::move(rest);
  } else if (!rest.empty()) {
    return usage_error(app, "unexpected argument " + in_quotes(rest.front()), quiet);
  }
  return std::nullopt;
}

}  // namespace dtensor::cli
