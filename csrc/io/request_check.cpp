#include "io/request_check.h"

#include <cerrno>
#include <limits>

namespace pagedoptim::io {
namespace {

bool aligned(uint64_t value) {
  return value % static_cast<uint64_t>(kDirectAlignment) == 0;
}

}  // namespace

int check_buffers(std::span<const iovec> buffers) noexcept {
  if (buffers.empty()) {
    return -EINVAL;
  }
  for (const iovec& b : buffers) {
    if (b.iov_base == nullptr || b.iov_len == 0) {
      return -EINVAL;
    }
  }
  return 0;
}

int check_transfer(const FileInfo& file, const void* buf, size_t length, int64_t offset) noexcept {
  if (!file.is_open()) {
    return -EBADF;
  }
  if (buf == nullptr || length == 0 || offset < 0 ||
      length > static_cast<uint64_t>(std::numeric_limits<int64_t>::max() - offset)) {
    return -EINVAL;
  }
  if (file.is_direct() &&
      !(aligned(reinterpret_cast<uintptr_t>(buf)) && aligned(length) && aligned(offset))) {
    return -EINVAL;
  }
  return 0;
}

int normalize_request(IoRequest& request, const FileInfo& file,
                      std::span<const iovec> buffers) noexcept {
  if (request.op != OpKind::kRead && request.op != OpKind::kWrite) {
    return -EINVAL;
  }
  if (request.buf_index < -1) {
    return -EINVAL;
  }
  if (request.buf_index >= 0) {
    if (static_cast<size_t>(request.buf_index) >= buffers.size()) {
      return -EINVAL;
    }
    const iovec& reg = buffers[static_cast<size_t>(request.buf_index)];
    const auto base = reinterpret_cast<uintptr_t>(reg.iov_base);
    if (request.buf == nullptr) {
      request.buf = reg.iov_base;
    }
    const auto start = reinterpret_cast<uintptr_t>(request.buf);
    if (start < base || start - base > reg.iov_len ||
        request.length > reg.iov_len - (start - base)) {
      return -EINVAL;
    }
  }
  return check_transfer(file, request.buf, request.length, request.offset);
}

}  // namespace pagedoptim::io
