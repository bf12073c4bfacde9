// The errors a paging store raises when the backing tier fails. The binding maps them onto
// Python exceptions once: PageIoError -> pagedoptim.PageIOError (an OSError with errno and
// filename set), PageCorruptionError -> pagedoptim.PageCorruptionError (a RuntimeError).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <system_error>

namespace pagedoptim::paging {

// An I/O error of the backing tier: a failed or short read or write, a full disk.
class PageIoError : public std::system_error {
 public:
  // `err` is a positive errno; `page` is -1 when the error is about the file as a whole.
  PageIoError(int err, std::string path, int32_t page, const std::string& what);

  int error_number() const noexcept { return code().value(); }
  const std::string& path() const noexcept { return path_; }
  int32_t page() const noexcept { return page_; }

 private:
  std::string path_;
  int32_t page_;
};

// A page whose bytes read back from the tier do not match the crc32c they were written
// with. The bytes are never handed to the kernel.
class PageCorruptionError : public std::runtime_error {
 public:
  PageCorruptionError(std::string path, int32_t page, uint32_t expected, uint32_t actual,
                      int attempts);

  const std::string& path() const noexcept { return path_; }
  int32_t page() const noexcept { return page_; }

 private:
  std::string path_;
  int32_t page_;
};

}  // namespace pagedoptim::paging
