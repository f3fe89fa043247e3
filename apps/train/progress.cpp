#include "progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <ostream>

namespace dtensor::train {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(std::llround(seconds));
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%lld:%02lld", s / 60, s % 60);
  }
  return buf;
}

std::string format_count(double v) {
  char buf[32];
  if (v >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  } else if (v >= 1e4) {
    std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  }
  return buf;
}

std::string format_progress(const ProgressState& s) {
  const int width = static_cast<int>(std::to_string(s.total).size());
  char buf[160];
  std::snprintf(buf, sizeof buf, "%*lld/%lld  loss %.4f  %s tok/s  lr %.2e  ETA %s", width,
                static_cast<long long>(s.step), static_cast<long long>(s.total), s.loss,
                format_count(s.tokens_per_s).c_str(), s.lr, format_duration(s.eta_s).c_str());
  if (std::isnan(s.bubble)) return std::string(buf) + s.routing;
  char bubble[64];
  std::snprintf(bubble, sizeof bubble, "  bubble %.0f%% (formula %.0f%%)", 100 * s.bubble,
                100 * s.bubble_formula);
  return std::string(buf) + bubble + s.routing;
}

ProgressBar::ProgressBar(std::ostream& out, bool tty, int64_t every)
    : out_(out), tty_(tty), every_(every < 1 ? 1 : every) {}

ProgressBar::~ProgressBar() { finish(); }

bool ProgressBar::stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }

void ProgressBar::update(const ProgressState& s) {
  if (!tty_) {
    if (s.step % every_ == 0 || s.step == s.total || s.step == 1) {
      out_ << "step " << format_progress(s) << '\n' << std::flush;
    }
    return;
  }
  // Redrawing costs a write per step; a few per second are enough to look live.
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && s.step != s.total && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  constexpr int kBar = 24;
  const int filled = s.total > 0 ? static_cast<int>(kBar * s.step / s.total) : kBar;
  last_ =
      "[" + std::string(filled, '#') + std::string(kBar - filled, '.') + "] " + format_progress(s);
  // The line, \033[K to clear what a longer old line left, then \r: the cursor waits at the
  // start for the next draw. Ending each draw with \r (not starting with it) lets a relay
  // such as dtrun forward it at once and keep its "[rank 0] " prefix in front of it.
  out_ << last_ << "\033[K\r" << std::flush;
  drawn_ = true;
}

void ProgressBar::message(const std::string& line) {
  if (tty_ && drawn_) {
    out_ << line << "\033[K\n" << last_ << "\033[K\r" << std::flush;
  } else {
    out_ << line << '\n' << std::flush;
  }
}

void ProgressBar::finish() {
  if (tty_ && drawn_) out_ << '\n' << std::flush;
  drawn_ = false;
}

}  // namespace dtensor::train
