// Opening the page file: O_DIRECT when the file system allows it, buffered otherwise.
#pragma once

#include <string>

#include "pagedoptim/io/io_engine.h"

namespace pagedoptim::io {

// The open(2) the probe calls; a parameter so that tests can play a file system that
// refuses O_DIRECT on kernels whose tmpfs accepts it.
using OpenFunction = int (*)(const char* path, int flags, unsigned mode);

// Opens `path` per `options` and fills `info`. With DirectMode::kAuto, O_DIRECT is refused
// when open fails with EINVAL or when an aligned probe read at offset 0 fails with EINVAL
// (some file systems accept the flag and reject the I/O); the file is then reopened
// buffered and info says why. 0 or -errno; on error `info` is left closed.
int open_page_file(const std::string& path, const OpenOptions& options, FileInfo& info,
                   OpenFunction open_fn = nullptr);

// Closes info.fd (if open) and resets info. 0 or -errno from close(2); the descriptor is
// released either way.
int close_page_file(FileInfo& info);

}  // namespace pagedoptim::io
