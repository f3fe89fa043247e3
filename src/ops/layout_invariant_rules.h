#pragma once
// What matrix_ops.cpp, reduction.cpp and vector_norm_ops.cpp register for the layout-invariant
// mode (layout_invariant.h).
#include "dtensor/dispatch/op_call.h"

namespace dtensor::ops::detail {

// `base` (an mm or addmm rule), except that a product whose contracted dim is sharded on one
// mesh dim comes out Replicate from the canonical segmented sum instead of Partial.
dispatch::Rule canonical_sum_rule(dispatch::Rule base, bool with_bias);

// `base` (a sum, or with `norm` a vector norm of finite order), except that a reduction over a dim
// sharded on one mesh dim comes out Replicate from the canonical segmented sum instead of
// pending.
dispatch::Rule canonical_reduction_rule(dispatch::Rule base, bool norm);

}  // namespace dtensor::ops::detail
