#pragma once
// Deprecated: error_message and show_cpp_stacktraces moved to dtensor/util/error_message.h
// (namespace dtensor::util), below every layer that reports errors. This header and the
// dtensor::comm names stay for one release (0.2) and then go.
#include "dtensor/util/error_message.h"

namespace dtensor::comm {

using util::error_message;
using util::show_cpp_stacktraces;

}  // namespace dtensor::comm
