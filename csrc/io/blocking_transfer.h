// pread/pwrite until the whole range has moved: the transfer loop of the POSIX backend and
// of every engine's blocking read_page/write_page.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pagedoptim/io/io_engine.h"

namespace pagedoptim::io {

// Retries EINTR, bounded EAGAIN and partial transfers. Returns the bytes moved (== length
// unless a read reached end of file) or -errno. On an O_DIRECT file a short read is final:
// the kernel shortens direct reads only at end of file, and the remainder would be
// misaligned. A write that moves 0 bytes for a non-empty range reports -EIO rather than
// spinning.
int64_t transfer_blocking(int fd, OpKind op, void* buf, size_t length, int64_t offset,
                          bool direct) noexcept;

}  // namespace pagedoptim::io
