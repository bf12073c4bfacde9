#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "pagedoptim/common.h"
#include "pagedoptim/paging/page_store.h"

namespace pagedoptim::paging {

void HostPageStore::AlignedFree::operator()(std::byte* p) const { std::free(p); }

HostPageStore::HostPageStore(int64_t page_bytes) : page_bytes_(page_bytes) {
  if (page_bytes <= 0 || page_bytes % kPageAlignment != 0) {
    throw std::invalid_argument("page_bytes must be a positive multiple of 4096, got " +
                                std::to_string(page_bytes));
  }
}

void HostPageStore::grow(int32_t num_pages) {
  pages_.reserve(size_t(num_pages));
  while (int32_t(pages_.size()) < num_pages) {
    void* memory = std::aligned_alloc(size_t(kPageAlignment), size_t(page_bytes_));
    if (memory == nullptr) throw std::bad_alloc();
    std::memset(memory, 0, size_t(page_bytes_));
    pages_.emplace_back(static_cast<std::byte*>(memory));
    pin_counts_.push_back(0);
  }
}

std::byte* HostPageStore::pin(int32_t page) {
  if (page < 0 || page >= num_pages()) {
    throw std::out_of_range("page " + std::to_string(page) + " does not exist");
  }
  ++pin_counts_[size_t(page)];
  return pages_[size_t(page)].get();
}

void HostPageStore::unpin(int32_t page, bool /*dirty*/) {
  if (page < 0 || page >= num_pages() || pin_counts_[size_t(page)] == 0) {
    throw std::logic_error("unpin of page " + std::to_string(page) + " that is not pinned");
  }
  --pin_counts_[size_t(page)];
}

}  // namespace pagedoptim::paging
