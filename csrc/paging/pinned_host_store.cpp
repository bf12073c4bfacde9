#include "pagedoptim/paging/pinned_host_store.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "pagedoptim/common.h"

namespace pagedoptim::paging {

PinnedHostStore::PinnedHostStore(device::Device& device, int64_t page_bytes)
    : device_(device), page_bytes_(page_bytes) {
  if (page_bytes <= 0 || page_bytes % kPageAlignment != 0) {
    throw std::invalid_argument("page_bytes must be a positive multiple of 4096, got " +
                                std::to_string(page_bytes));
  }
}

PinnedHostStore::~PinnedHostStore() {
  for (void* slab : slabs_) device_.release_host(slab);
}

void PinnedHostStore::grow(int32_t num_pages) {
  if (num_pages <= this->num_pages()) return;
  const int64_t added = int64_t(num_pages) - this->num_pages();
  const int64_t bytes = added * page_bytes_;
  void* slab = nullptr;
  try {
    slab = device_.allocate_host(bytes);
  } catch (const device::MemoryRefused& e) {
    const int64_t held = resident_bytes();
    throw device::MemoryRefused(
        true, bytes,
        "could not pin " + std::to_string(bytes) + " bytes of host memory for optimizer state (" +
            std::to_string(held) + " bytes already pinned): " + e.what() +
            ". offload='nvme' keeps cold pages in a page file instead of pinned memory");
  }
  std::memset(slab, 0, size_t(bytes));
  slabs_.push_back(slab);
  auto* base = static_cast<std::byte*>(slab);
  for (int64_t i = 0; i < added; ++i) pages_.push_back(base + i * page_bytes_);
  num_pages_.store(num_pages);
}

std::byte* PinnedHostStore::pin(int32_t page) {
  if (page < 0 || page >= num_pages()) {
    throw std::out_of_range("page " + std::to_string(page) + " does not exist");
  }
  return pages_[size_t(page)];
}

void PinnedHostStore::unpin(int32_t page, bool /*dirty*/) {
  if (page < 0 || page >= num_pages()) {  // reads only the atomic count: see num_pages_
    throw std::out_of_range("page " + std::to_string(page) + " does not exist");
  }
}

}  // namespace pagedoptim::paging
