#pragma once
// CRC-32C (Castagnoli, the iSCSI/ext4 checksum): the per-tensor checksum of checkpoints.
// Public so that tools can check a checkpoint's tensors against its metadata.
#include <cstddef>
#include <cstdint>

namespace dtensor::checkpoint {

/// Checksum of `size` bytes, continuing from `crc` (the checksum of the bytes before; 0 to
/// start). crc32c(b, n) == crc32c(b + k, n - k, crc32c(b, k)). Uses the SSE4.2 instruction
/// where the CPU has it.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

namespace detail {
/// The table-driven version every CPU runs (exposed to test the fast path against it).
uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc = 0);
}  // namespace detail

}  // namespace dtensor::checkpoint
