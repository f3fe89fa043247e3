#include "loss_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace dtensor::train {
namespace {

constexpr double kWidth = 720, kHeight = 420;
constexpr double kLeft = 70, kRight = 20, kTop = 40, kBottom = 50;

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

std::string tick_label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", std::abs(v) < 1e-12 ? 0.0 : v);
  return buf;
}

std::string escape_xml(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push_back(t);
  }
  return ticks;
}

std::string loss_curve_svg(const std::vector<MetricsRow>& rows, const std::string& title) {
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" viewBox=\"0 0 " << kWidth << ' ' << kHeight
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kWidth / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">"
      << escape_xml(title) << "</text>\n";

  // Data range over both curves; non-finite losses are left out of the plot.
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo;
  double y_lo = x_lo, y_hi = -x_lo;
  auto take = [&](double x, double y) {
    if (!std::isfinite(y)) return;
    x_lo = std::min(x_lo, x);
    x_hi = std::max(x_hi, x);
    y_lo = std::min(y_lo, y);
    y_hi = std::max(y_hi, y);
  };
  for (const auto& r : rows) {
    take(static_cast<double>(r.step), r.loss);
    if (r.val_loss) take(static_cast<double>(r.step), *r.val_loss);
  }
  if (!std::isfinite(x_lo)) {
    svg << "<text x=\"" << kWidth / 2 << "\" y=\"" << kHeight / 2
        << "\" text-anchor=\"middle\">no finite loss values to plot</text>\n</svg>\n";
    return svg.str();
  }
  if (x_hi == x_lo) x_hi = x_lo + 1;
  if (y_hi == y_lo) y_hi = y_lo + 1;
  const auto y_ticks = nice_ticks(y_lo, y_hi, 6);
  const auto x_ticks = nice_ticks(x_lo, x_hi, 8);
  y_lo = std::min(y_lo, y_ticks.front());
  y_hi = std::max(y_hi, y_ticks.back());
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (x - x_lo) / (x_hi - x_lo) * pw; };
  auto py = [&](double y) { return kTop + (1.0 - (y - y_lo) / (y_hi - y_lo)) * ph; };

  // Grid, ticks and axis labels.
  for (double t : y_ticks) {
    svg << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + pw << "\" y1=\"" << num(py(t))
        << "\" y2=\"" << num(py(t)) << "\" stroke=\"#e5e5e5\"/>\n"
        << "<text x=\"" << kLeft - 6 << "\" y=\"" << num(py(t) + 4) << "\" text-anchor=\"end\">"
        << tick_label(t) << "</text>\n";
  }
  for (double t : x_ticks) {
    if (t < x_lo || t > x_hi) continue;
    svg << "<line x1=\"" << num(px(t)) << "\" x2=\"" << num(px(t)) << "\" y1=\"" << kTop + ph
        << "\" y2=\"" << kTop + ph + 5 << "\" stroke=\"#333\"/>\n"
        << "<text x=\"" << num(px(t)) << "\" y=\"" << kTop + ph + 18 << "\" text-anchor=\"middle\">"
        << tick_label(t) << "</text>\n";
  }
  svg << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" fill=\"none\" stroke=\"#333\"/>\n"
      << "<text x=\"" << kLeft + pw / 2 << "\" y=\"" << kHeight - 12
      << "\" text-anchor=\"middle\">step</text>\n"
      << "<text transform=\"translate(16 " << kTop + ph / 2
      << ") rotate(-90)\" text-anchor=\"middle\">loss</text>\n";

  // Training loss as one polyline (broken where a loss is not finite).
  std::string points;
  auto flush_line = [&] {
    if (!points.empty()) {
      svg << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"" << points
          << "\"/>\n";
    }
    points.clear();
  };
  for (const auto& r : rows) {
    if (!std::isfinite(r.loss)) {
      flush_line();
      continue;
    }
    points +=
        (points.empty() ? "" : " ") + num(px(static_cast<double>(r.step))) + "," + num(py(r.loss));
  }
  flush_line();
  bool any_val = false;
  for (const auto& r : rows) {
    if (!r.val_loss || !std::isfinite(*r.val_loss)) continue;
    any_val = true;
    svg << "<circle cx=\"" << num(px(static_cast<double>(r.step))) << "\" cy=\""
        << num(py(*r.val_loss)) << "\" r=\"3.5\" fill=\"#d62728\"/>\n";
  }

  // Legend in the top-right corner of the plot.
  const double lx = kLeft + pw - 150, ly = kTop + 16;
  svg << "<line x1=\"" << lx << "\" x2=\"" << lx + 24 << "\" y1=\"" << ly << "\" y2=\"" << ly
      << "\" stroke=\"#1f77b4\" stroke-width=\"2\"/>\n"
      << "<text x=\"" << lx + 30 << "\" y=\"" << ly + 4 << "\">training loss</text>\n";
  if (any_val) {
    svg << "<circle cx=\"" << lx + 12 << "\" cy=\"" << ly + 18
        << "\" r=\"3.5\" fill=\"#d62728\"/>\n"
        << "<text x=\"" << lx + 30 << "\" y=\"" << ly + 22 << "\">validation loss</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

void write_loss_curve_svg(const std::string& path, const std::vector<MetricsRow>& rows,
                          const std::string& title) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write plot '" + path + "'");
  out << loss_curve_svg(rows, title);
  if (!out) throw std::runtime_error("error writing plot '" + path + "'");
}

}  // namespace dtensor::train
