#pragma once
// metrics.csv: one row per optimizer step, written and flushed as training goes so a crashed
// or interrupted run keeps its history. Columns:
//   step,loss,val_loss,lr,tokens_per_s,step_ms,grad_norm
// Losses and the gradient norm have 9 significant digits: a float32 value reads back exactly.
// val_loss is empty on steps without an evaluation. step is 1-based (the number of
// optimizer steps taken when the row was written).
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace dtensor::train {

struct MetricsRow {
  int64_t step = 0;
  double loss = 0;
  std::optional<double> val_loss;
  double lr = 0;
  double tokens_per_s = 0;
  double step_ms = 0;
  double grad_norm = 0;
};

inline constexpr const char* kMetricsHeader =
    "step,loss,val_loss,lr,tokens_per_s,step_ms,grad_norm";

// Parses a metrics.csv; throws naming the file and line on a malformed row.
std::vector<MetricsRow> read_metrics_csv(const std::string& path);

class MetricsWriter {
 public:
  // Creates `path` with the header. With `keep_through_step` >= 0 (a resumed run) the rows of
  // an existing file up to that step are kept and later ones dropped, so the file describes
  // one continuous run.
  explicit MetricsWriter(const std::string& path, int64_t keep_through_step = -1);
  void write(const MetricsRow& row);
  const std::string& path() const { return path_; }
  // Every row in the file: the kept ones and those written since.
  const std::vector<MetricsRow>& rows() const { return rows_; }

 private:
  std::string path_;
  std::ofstream out_;
  std::vector<MetricsRow> rows_;
};

std::string format_metrics_row(const MetricsRow& row);

}  // namespace dtensor::train
