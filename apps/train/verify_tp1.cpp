#include "verify_tp1.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <set>

#include "common/trainer.h"
#include "dtensor/checkpoint/checkpoint.h"

namespace dtensor::train {

Trainer make_reference_trainer(const RunConfig& config, const std::string& resume_from) {
  Trainer reference(one_device(config), std::nullopt);
  if (!resume_from.empty()) {
    checkpoint::load_checkpoint(resume_from, reference.model(), &reference.optimizer());
  }
  return reference;
}

VerifyReport verify_against_one_device(
    Trainer& reference, const BatchSampler& train, const std::vector<double>& tp_losses,
    int64_t first_step, double rtol, const std::function<void(int64_t, int64_t, double)>& on_step) {
  VerifyReport report;
  report.rtol = rtol;
  const int64_t n = static_cast<int64_t>(tp_losses.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t step = first_step + i;
    const double ref = reference.train_step(step, train.get(step)).loss;
    LossComparison c{step + 1, tp_losses[i], ref, std::abs(tp_losses[i] - ref) / std::abs(ref)};
    if (!std::isfinite(c.rel_diff)) c.rel_diff = std::numeric_limits<double>::infinity();
    if (c.rel_diff >= report.max_rel_diff) {
      report.max_rel_diff = c.rel_diff;
      report.worst_step = c.step;
    }
    report.rows.push_back(c);
    if (on_step) on_step(i + 1, n, ref);
  }
  report.passed = !report.rows.empty() && report.max_rel_diff <= report.rtol;
  return report;
}

void print_verify_report(std::ostream& out, const VerifyReport& r, const std::string& run,
                         size_t max_rows) {
  std::set<size_t> shown;
  const size_t n = r.rows.size();
  for (size_t i = 0; i < std::min<size_t>(3, n); ++i) shown.insert(i);
  for (size_t k = 1; k + 1 < max_rows && n > 0; ++k) shown.insert(k * (n - 1) / (max_rows - 2));
  if (n > 0) shown.insert(n - 1);
  for (size_t i = 0; i < n; ++i) {
    if (r.rows[i].step == r.worst_step) shown.insert(i);
  }
  char buf[160];
  const std::string tp_col = "loss " + run;
  std::snprintf(buf, sizeof buf, "%8s  %14s  %14s  %10s", "step", tp_col.c_str(), "loss TP=1",
                "rel diff");
  out << buf << '\n';
  size_t previous = 0;
  bool first = true;
  for (size_t i : shown) {
    if (!first && i > previous + 1) out << "     ...\n";
    first = false;
    previous = i;
    const auto& c = r.rows[i];
    std::snprintf(buf, sizeof buf, "%8lld  %14.8f  %14.8f  %10.2e%s",
                  static_cast<long long>(c.step), c.loss_tp, c.loss_ref, c.rel_diff,
                  c.step == r.worst_step ? "  <- largest" : "");
    out << buf << '\n';
  }
  std::snprintf(buf, sizeof buf,
                "verify-tp1: %s: largest relative difference %.2e at step %lld over %zu steps "
                "(tolerance %.1e)",
                r.passed ? "PASSED" : "FAILED", r.max_rel_diff,
                static_cast<long long>(r.worst_step), n, r.rtol);
  out << buf << '\n';
}

}  // namespace dtensor::train
