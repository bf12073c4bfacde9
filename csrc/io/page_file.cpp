#include "io/page_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace pagedoptim::io {
namespace {

int system_open(const char* path, int flags, unsigned mode) {
  return ::open(path, flags, static_cast<mode_t>(mode));
}

int open_retrying(OpenFunction open_fn, const std::string& path, int flags) {
  for (;;) {
    const int fd = open_fn(path.c_str(), flags, 0600);
    if (fd >= 0 || errno != EINTR) {
      return fd >= 0 ? fd : -errno;
    }
  }
}

// Some file systems accept O_DIRECT at open and reject every transfer, so the probe reads
// one aligned block. A read at or past end of file returns 0, which is fine: the
// alignment checks happen before the size check.
int probe_direct_read(int fd) {
  void* block = std::aligned_alloc(kDirectAlignment, kDirectAlignment);
  if (block == nullptr) {
    return -ENOMEM;
  }
  ssize_t n;
  do {
    n = ::pread(fd, block, kDirectAlignment, 0);
  } while (n < 0 && errno == EINTR);
  const int err = n < 0 ? -errno : 0;
  std::free(block);
  return err;
}

std::string refused_reason(const char* step, int err) {
  return std::string("the file system refused O_DIRECT (") + step + ": " + std::strerror(err) +
         "); using buffered I/O, so pages also pass through the kernel page cache";
}

}  // namespace

int open_page_file(const std::string& path, const OpenOptions& options, FileInfo& info,
                   OpenFunction open_fn) {
  if (open_fn == nullptr) {
    open_fn = &system_open;
  }
  info = FileInfo{};
  int flags = O_RDWR | O_CLOEXEC;
  if (options.create) {
    flags |= O_CREAT;
  }
  if (options.truncate) {
    flags |= O_TRUNC;
  }

  if (options.direct != DirectMode::kOff) {
    const int fd = open_retrying(open_fn, path, flags | O_DIRECT);
    int refused = 0;
    const char* step = "open";
    if (fd >= 0) {
      const int probe = probe_direct_read(fd);
      if (probe == 0) {
        info.path = path;
        info.fd = fd;
        info.direct = DirectStatus::kDirect;
        return 0;
      }
      ::close(fd);
      if (probe != -EINVAL) {
        return probe;
      }
      refused = EINVAL;
      step = "aligned read";
    } else if (fd == -EINVAL) {
      refused = EINVAL;
    } else {
      return fd;
    }
    if (options.direct == DirectMode::kRequire) {
      return -refused;
    }
    info.direct = DirectStatus::kBufferedRefused;
    info.direct_errno = refused;
    info.direct_reason = refused_reason(step, refused);
  } else {
    info.direct = DirectStatus::kBufferedByOption;
    info.direct_reason = "O_DIRECT disabled by option; using buffered I/O";
  }

  // O_TRUNC again is harmless: the first attempt may already have truncated.
  const int fd = open_retrying(open_fn, path, flags);
  if (fd < 0) {
    info = FileInfo{};
    return fd;
  }
  info.path = path;
  info.fd = fd;
  return 0;
}

int close_page_file(FileInfo& info) {
  int err = 0;
  if (info.fd >= 0 && ::close(info.fd) != 0) {
    // Linux releases the descriptor even when close reports an error (EINTR included),
    // so retrying could close a descriptor another thread has just been given.
    err = -errno;
  }
  info = FileInfo{};
  return err;
}

}  // namespace pagedoptim::io
