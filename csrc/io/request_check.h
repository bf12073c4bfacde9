// Validation of requests at the engine boundary, shared by every backend.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "pagedoptim/io/io_engine.h"

namespace pagedoptim::io {

// -EINVAL for an empty list, a null base or a zero length.
int check_buffers(std::span<const iovec> buffers) noexcept;

// Checks one transfer against the open file: 0, -EBADF (no file) or -EINVAL (null buffer,
// zero length, negative or overflowing offset, misaligned on an O_DIRECT file).
int check_transfer(const FileInfo& file, const void* buf, size_t length, int64_t offset) noexcept;

// Checks `request` and resolves a registered buffer index (a null buf becomes the buffer's
// start; a given buf must lie inside it with its length). 0 or a negative errno.
int normalize_request(IoRequest& request, const FileInfo& file,
                      std::span<const iovec> buffers) noexcept;

}  // namespace pagedoptim::io
