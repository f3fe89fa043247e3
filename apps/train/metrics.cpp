#include "metrics.h"

#include <cstdio>
#include <filesystem>
#include <sstream>
#include <stdexcept>

namespace dtensor::train {
namespace {

std::vector<std::string> split_commas(const std::string& line) {
  std::vector<std::string> cells;
  std::string cell;
  std::istringstream ss(line);
  while (std::getline(ss, cell, ',')) cells.push_back(cell);
  if (!line.empty() && line.back() == ',') cells.emplace_back();
  return cells;
}

double to_double(const std::string& s, const std::string& where) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = std::string::npos;
  }
  if (used != s.size()) throw std::runtime_error(where + ": '" + s + "' is not a number");
  return v;
}

}  // namespace

std::string format_metrics_row(const MetricsRow& r) {
  char buf[256];
  std::string val;
  if (r.val_loss) {
    char v[32];
    std::snprintf(v, sizeof v, "%.9g", *r.val_loss);
    val = v;
  }
  std::snprintf(buf, sizeof buf, "%lld,%.9g,%s,%.6e,%.1f,%.3f,%.9g", static_cast<long long>(r.step),
                r.loss, val.c_str(), r.lr, r.tokens_per_s, r.step_ms, r.grad_norm);
  return buf;
}

std::vector<MetricsRow> read_metrics_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open metrics file '" + path + "'");
  std::vector<MetricsRow> rows;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line_no == 1) {
      if (line != kMetricsHeader) {
        throw std::runtime_error(path + ": unexpected header '" + line + "', expected '" +
                                 kMetricsHeader + "'");
      }
      continue;
    }
    if (line.empty()) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    auto c = split_commas(line);
    if (c.size() != 7) {
      throw std::runtime_error(where + ": expected 7 columns, found " + std::to_string(c.size()));
    }
    MetricsRow r;
    r.step = static_cast<int64_t>(to_double(c[0], where));
    r.loss = to_double(c[1], where);
    if (!c[2].empty()) r.val_loss = to_double(c[2], where);
    r.lr = to_double(c[3], where);
    r.tokens_per_s = to_double(c[4], where);
    r.step_ms = to_double(c[5], where);
    r.grad_norm = to_double(c[6], where);
    rows.push_back(r);
  }
  return rows;
}

MetricsWriter::MetricsWriter(const std::string& path, int64_t keep_through_step) : path_(path) {
  if (keep_through_step >= 0 && std::filesystem::exists(path)) {
    for (const auto& r : read_metrics_csv(path)) {
      if (r.step <= keep_through_step) rows_.push_back(r);
    }
  }
  out_.open(path, std::ios::trunc);
  if (!out_) throw std::runtime_error("cannot write metrics file '" + path + "'");
  out_ << kMetricsHeader << '\n';
  for (const auto& r : rows_) out_ << format_metrics_row(r) << '\n';
  out_.flush();
}

void MetricsWriter::write(const MetricsRow& row) {
  out_ << format_metrics_row(row) << '\n';
  out_.flush();
  rows_.push_back(row);
}

}  // namespace dtensor::train
