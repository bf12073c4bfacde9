// Every page in page-locked host memory that a device copies from and to asynchronously:
// the home of each page under a device cache with offload="host". Pages come in slabs, one
// per growth (a parameter's pages), allocated once through the device and kept for the
// life of the store; new pages are zero-filled.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "pagedoptim/device/device.h"
#include "pagedoptim/paging/page_store.h"

namespace pagedoptim::paging {

class PinnedHostStore final : public PageStore {
 public:
  // `device` must outlive the store.
  PinnedHostStore(device::Device& device, int64_t page_bytes);
  ~PinnedHostStore() override;
  PinnedHostStore(const PinnedHostStore&) = delete;
  PinnedHostStore& operator=(const PinnedHostStore&) = delete;

  // Throws device::MemoryRefused naming the bytes, with a hint to use offload="nvme".
  void grow(int32_t num_pages) override;
  std::byte* pin(int32_t page) override;
  void unpin(int32_t page, bool dirty) override;
  int32_t num_pages() const override { return num_pages_.load(); }
  int64_t page_bytes() const override { return page_bytes_; }
  int64_t resident_bytes() const override { return page_bytes_ * num_pages(); }

 private:
  device::Device& device_;
  int64_t page_bytes_;
  std::vector<void*> slabs_;
  std::vector<std::byte*> pages_;
  // A device cache's retirer unpins from its own thread while the step's thread grows.
  std::atomic<int32_t> num_pages_{0};
};

}  // namespace pagedoptim::paging
