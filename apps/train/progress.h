#pragma once
// The progress display of rank 0, on stderr. On a terminal one line is redrawn in place
//   [#########.........]  45/200  loss 2.3140  12.5k tok/s  lr 2.9e-03  ETA 0:31
// Elsewhere (a log file, a pipe) a plain line is printed every `every` steps and at the last
// step, since carriage returns would garble it. Under dtrun stderr is a pipe even when dtrun's
// is a terminal: dtensor_train --progress bar (what scripts/demo passes on a terminal) asks
// for the bar then, and dtrun relays each redraw behind its "[rank 0] " prefix.
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <limits>
#include <string>

namespace dtensor::train {

struct ProgressState {
  int64_t step = 0;  // steps done (1-based)
  int64_t total = 0;
  double loss = 0;
  double tokens_per_s = 0;
  double lr = 0;
  double eta_s = 0;
  // --pp: the measured pipeline bubble of the step and the schedule's formula (shown when the
  // measured one is a number).
  double bubble = std::numeric_limits<double>::quiet_NaN();
  double bubble_formula = 0;
  // With mixture-of-experts layers: the routing since the last line (train_run's
  // routing_summary), shown after the rest; empty otherwise.
  std::string routing = "";
};

class ProgressBar {
 public:
  // `tty`: redraw in place; `every`: steps between plain lines (ignored on a terminal).
  ProgressBar(std::ostream& out, bool tty, int64_t every);
  ~ProgressBar();
  void update(const ProgressState& s);
  // Prints a whole line without breaking the bar (clears it and redraws it after).
  void message(const std::string& line);
  // Ends the bar's line (called once when training ends).
  void finish();

  static bool stderr_is_tty();

 private:
  std::ostream& out_;
  bool tty_;
  int64_t every_;
  bool drawn_ = false;
  std::string last_;
  std::chrono::steady_clock::time_point last_draw_{};
};

// "1:02:03", "4:05", "0:07": a duration for humans.
std::string format_duration(double seconds);
// "950", "12.5k", "3.10M": a rate for humans.
std::string format_count(double v);
// The text of one progress line (without bar or newline), e.g. "45/200  loss 2.3140 ...".
std::string format_progress(const ProgressState& s);

}  // namespace dtensor::train
