#include "io/file_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "io/blocking_transfer.h"
#include "io/page_file.h"
#include "io/request_check.h"

namespace pagedoptim::io {

int FileEngine::open(const std::string& path, const OpenOptions& options) {
  if (file_.is_open() || in_flight() > 0) {
    return -EBUSY;
  }
  FileInfo info;
  const int err = open_page_file(path, options, info);
  if (err < 0) {
    return err;
  }
  file_ = std::move(info);
  const int hook = after_open();
  if (hook < 0) {
    close_page_file(file_);
    return hook;
  }
  return 0;
}

int FileEngine::close() {
  if (in_flight() > 0) {
    return -EBUSY;
  }
  if (!file_.is_open()) {
    return 0;
  }
  before_close();
  return close_page_file(file_);
}

int FileEngine::reserve(int64_t bytes) {
  if (!file_.is_open()) {
    return -EBADF;
  }
  if (bytes < 0) {
    return -EINVAL;
  }
  if (bytes == 0) {
    return 0;
  }
  int err;
  do {
    err = ::posix_fallocate(file_.fd, 0, bytes);
  } while (err == EINTR);
  return -err;
}

int FileEngine::sync() {
  if (!file_.is_open()) {
    return -EBADF;
  }
  int r;
  do {
    r = ::fdatasync(file_.fd);
  } while (r != 0 && errno == EINTR);
  return r == 0 ? 0 : -errno;
}

int64_t FileEngine::read_page(void* buf, size_t length, int64_t offset) {
  const int err = check_transfer(file_, buf, length, offset);
  if (err < 0) {
    return err;
  }
  return transfer_blocking(file_.fd, OpKind::kRead, buf, length, offset, file_.is_direct());
}

int64_t FileEngine::write_page(const void* buf, size_t length, int64_t offset) {
  const int err = check_transfer(file_, buf, length, offset);
  if (err < 0) {
    return err;
  }
  return transfer_blocking(file_.fd, OpKind::kWrite, const_cast<void*>(buf), length, offset,
                           file_.is_direct());
}

}  // namespace pagedoptim::io
