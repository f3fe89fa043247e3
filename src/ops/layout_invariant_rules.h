#pragma once
// What matrix_ops.cpp registers for the layout-invariant mode (layout_invariant.h).
#include "dtensor/dispatch/op_call.h"

namespace dtensor::ops::detail {

// `base` (an mm or addmm rule), except that a product whose contracted dim is sharded on one
// mesh dim comes out Replicate from the canonical segmented sum instead of Partial.
dispatch::Rule canonical_sum_rule(dispatch::Rule base, bool with_bias);

}  // namespace dtensor::ops::detail
