#pragma once
// Internal: the loss_parallel rules. The ordinary softmax / nll_loss rules branch to these
// while the LossParallel bit is set (one registration per op, so no static-init order issue).
#include "dtensor/dispatch/op_call.h"
#include "dtensor/tp/loss_parallel.h"

namespace dtensor::tp::detail {

dispatch::Decision log_softmax(const dispatch::OpCall& call);
dispatch::Decision log_softmax_backward(const dispatch::OpCall& call);
dispatch::Decision nll_forward(const dispatch::OpCall& call);
dispatch::Decision nll_backward(const dispatch::OpCall& call);

}  // namespace dtensor::tp::detail
