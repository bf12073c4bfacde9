#include "io/blocking_transfer.h"

#include <unistd.h>

#include <cerrno>

namespace pagedoptim::io {
namespace {

// EAGAIN on a regular file is rare (a non-blocking descriptor, a congested network file
// system); a bound keeps a persistent one from turning into a hang.
constexpr int kMaxEagainRetries = 1000;

}  // namespace

int64_t transfer_blocking(int fd, OpKind op, void* buf, size_t length, int64_t offset,
                          bool direct) noexcept {
  auto* bytes = static_cast<char*>(buf);
  size_t done = 0;
  int eagain = 0;
  while (done < length) {
    const int64_t at = offset + static_cast<int64_t>(done);
    const ssize_t n = op == OpKind::kRead ? ::pread(fd, bytes + done, length - done, at)
                                          : ::pwrite(fd, bytes + done, length - done, at);
    if (n < 0) {
      if (errno == EINTR || (errno == EAGAIN && ++eagain < kMaxEagainRetries)) {
        continue;
      }
      return -errno;
    }
    if (n == 0) {
      if (op == OpKind::kRead) {
        break;
      }
      return -EIO;
    }
    done += static_cast<size_t>(n);
    if (direct && op == OpKind::kRead && done < length) {
      break;
    }
  }
  return static_cast<int64_t>(done);
}

}  // namespace pagedoptim::io
