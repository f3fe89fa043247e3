// Joins the job from the launcher's environment and checks one collective: used to test that
// our binaries run under dtrun and under torchrun --no-python.
#include <dtensor/dtensor.h>

#include <cstdio>

int main() {
  dtensor::comm::init_process_group();
  const int rank = dtensor::comm::get_rank(), world = dtensor::comm::get_world_size();
  auto mesh = dtensor::init_device_mesh("cpu", {world});
  auto sum = dtensor::full_tensor(
      dtensor::from_local(at::full({1}, static_cast<float>(rank)), mesh, {dtensor::Partial()}));
  const float expected = world * (world - 1) / 2.0f;
  const bool ok = sum.item<float>() == expected;
  std::printf("rank %d of %d: sum of ranks %g (%s), backend %s\n", rank, world, sum.item<float>(),
              ok ? "ok" : "WRONG", dtensor::comm::cpu_backend_name().c_str());
  return ok ? 0 : 1;
}
