#include "pagedoptim/paging/page_errors.h"

#include <cstdio>

namespace pagedoptim::paging {
namespace {

std::string hex32(uint32_t value) {
  char buffer[16];
  std::snprintf(buffer, sizeof(buffer), "0x%08x", value);
  return buffer;
}

}  // namespace

PageIoError::PageIoError(int err, std::string path, int32_t page, const std::string& what)
    : std::system_error(err, std::generic_category(), what), path_(std::move(path)), page_(page) {}

PageCorruptionError::PageCorruptionError(std::string path, int32_t page, uint32_t expected,
                                         uint32_t actual, int attempts)
    : std::runtime_error("page " + std::to_string(page) + " read from " + path +
                         " failed its checksum (crc32c " + hex32(actual) + ", written as " +
                         hex32(expected) + ") in " + std::to_string(attempts) +
                         (attempts == 1 ? " attempt" : " attempts") +
                         "; its bytes were not used"),
      path_(std::move(path)),
      page_(page) {}

}  // namespace pagedoptim::paging
