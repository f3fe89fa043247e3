#include <dtensor/dtensor.h>

#include <cstdio>

int main() {
  dtensor::comm::init_process_group();
  auto mesh = dtensor::init_device_mesh("cpu", {dtensor::comm::get_world_size()});
  auto t = at::arange(12, at::kFloat).view({4, 3});
  auto dt = dtensor::distribute_tensor(t, mesh, {dtensor::Shard(0)});
  const bool ok = dtensor::full_tensor(dt * 2).equal(t * 2);
  std::printf("consumer %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
