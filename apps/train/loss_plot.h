#pragma once
// The loss curve as a self-contained SVG (no fonts, scripts or images to fetch): training
// loss as a line, validation loss as dots, axes with round tick values and a legend.
#include <string>
#include <vector>

#include "metrics.h"

namespace dtensor::train {

// The SVG document for `rows` (in step order). `title` is drawn above the plot.
std::string loss_curve_svg(const std::vector<MetricsRow>& rows, const std::string& title);

// Writes loss_curve_svg() to `path`; throws when the file cannot be written.
void write_loss_curve_svg(const std::string& path, const std::vector<MetricsRow>& rows,
                          const std::string& title);

// Round tick values covering [lo, hi] (about `target` of them, steps of 1, 2 or 5 x 10^k).
std::vector<double> nice_ticks(double lo, double hi, int target);

}  // namespace dtensor::train
