// crc32c (Castagnoli polynomial, as in iSCSI, ext4 and SSE4.2): the page checksum.
//
// The value is the standard one (initial value and final XOR 0xFFFFFFFF), e.g.
// crc32c("123456789", 9) == 0xE3069283. Passing the crc of a prefix as `crc` continues it:
// crc32c(b, nb, crc32c(a, na)) == crc32c of the concatenation a + b.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagedoptim::io {

// Uses the SSE4.2 crc32 instruction when the CPU has it (decided once, at run time; the
// library itself is built without -msse4.2), the portable version otherwise.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0) noexcept;

// Slicing-by-8 tables; any CPU.
uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc = 0) noexcept;

// The SSE4.2 version. Only valid when crc32c_hardware_available(); on other CPUs (and
// other architectures) it forwards to crc32c_portable so that calling it is never undefined.
uint32_t crc32c_hardware(const void* data, size_t size, uint32_t crc = 0) noexcept;
bool crc32c_hardware_available() noexcept;

}  // namespace pagedoptim::io
