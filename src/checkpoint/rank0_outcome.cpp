#include "dtensor/checkpoint/rank0_outcome.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "dtensor/comm/collectives.h"
#include "dtensor/util/error_message.h"
#include "dtensor/comm/process_group.h"

namespace dtensor::checkpoint::detail {
namespace {

constexpr int64_t kMessageBytes = 1024;  // enough for an error's first lines

}  // namespace

int global_rank() { return comm::is_initialized() ? comm::get_rank() : 0; }

void share_rank0_outcome(std::exception_ptr error_on_rank0, const std::string& what) {
  if (!comm::is_initialized() || comm::get_world_size() == 1) {
    if (error_on_rank0) std::rethrow_exception(error_on_rank0);
    return;
  }
  // Byte 0: 1 = success; then rank 0's message, NUL-terminated.
  at::Tensor status = at::zeros({kMessageBytes}, at::kByte);
  if (comm::get_rank() == 0) {
    auto* p = status.mutable_data_ptr<uint8_t>();
    if (!error_on_rank0) {
      p[0] = 1;
    } else {
      const std::string msg = util::error_message(error_on_rank0);
      std::memcpy(p + 1, msg.data(), std::min<size_t>(msg.size(), kMessageBytes - 2));
    }
  }
  status = comm::broadcast(status, 0, *comm::world_group());
  if (comm::get_rank() == 0) {
    if (error_on_rank0) std::rethrow_exception(error_on_rank0);
    return;
  }
  const auto* p = status.const_data_ptr<uint8_t>();
  TORCH_CHECK(p[0] == 1, what, " failed on rank 0: ", reinterpret_cast<const char*>(p + 1));
}

}  // namespace dtensor::checkpoint::detail
